"""Kill soak: the three example links and the epoch block run while this process SIGKILLs drivers and Python workers at random times.

The links are the driver programs of :mod:`lastagent.examples`, each run to its end with
``trigger(availableNow=True)``:

* ``sink``  — ``sink-driver``: a Delta table (appended in many small commits, one per epoch) → ``lastagent-kafka``;
* ``kafka`` — ``kafka-driver``: a Kafka topic (2 partitions) → ``lastagent-kafka``;
* ``delta`` — ``delta-driver``: a Kafka topic of ``order-<t>-<i>`` values and a few poison records →
  ``lastagent.examples:enrich`` → ``lastagent-delta``, dead letters to a topic and every row to a side topic;
* ``merge`` — ``merge-driver``: a Kafka topic of ``{"id", "amount"}`` changes → ``foreachBatch`` with a
  ``lastagent.epoch`` block: an event per change to a topic and a Spark MERGE into a Delta table, one epoch.

A supervisor starts one driver at a time, round-robin over the links, each as its own session
(``start_new_session``) with ``local[2,64]`` (Spark retries a task whose Python worker died). Per run, from a
seeded RNG, it plans:

* a *driver* kill: SIGKILL of every process of the driver's session (the driver, its JVM, Spark's Python
  daemons and workers — the daemons move to process groups of their own, so the session is what is
  killed) at ``u * horizon`` seconds after the start, ``u ~ U(0.1, 1)``, where ``horizon`` is
  ``--horizon-factor`` (2) times the median of the link's last restart→first-commit times (``--initial-horizon``
  before there is one; stretched after kills that all came before a first commit): about 45% of the driver
  kills land in start-up and recovery, the rest among epochs;
* *worker* kills (1 to ``--worker-kills-per-run``, default 2): each a SIGKILL of one executor Python worker (a
  child of ``pyspark.daemon pyspark.worker``, or a ``-m pyspark.worker`` process when the daemon is off) at
  random times before the driver kill, at the first moment from that time on when such a worker exists; the
  driver goes on (the task is retried, or the query fails and is restarted: counted).

Whether Spark's Python daemon is on is drawn per run too. Before each start, the link's source is topped up
so that about ``--backlog-epochs`` epochs of work wait (a producer feeding the soak between runs). Every kill
is logged (link, kill number, seconds since the driver started, what was killed); every run logs the time
from its start to the first epoch it committed (a new ``txn`` action of the link in the arbitration table,
or in the target table for the Delta link and the block, whose app id is ``lastagent/<link>/g<n>``; read from
the ``_delta_log`` commit files).

When ``--kills`` kills are done, the source stops growing and every link runs once more to its end without
kills. Then the verification, independent of the connector's own bookkeeping:

* every source record exactly once in each output: a ``read_committed`` consumer reads the Kafka outputs
  (incl. dead letters and the side topic) to their end; Spark's Delta reader reads the Delta outputs (the
  block's table must hold each key's last amount);
* no open transaction of any link (``KafkaXAResource.recover("lastagent-<link>-") == []``);
* ``lastagent status`` exits 0 for every link;
* no data file in the Delta link's table that no commit references (the block's table is Spark's own MERGE's:
  a killed MERGE leaves its files to VACUUM, as Spark does).

The report (``--report``, JSON) is rewritten after every run, so a partial run leaves a useful one
(``status: running``); the log on stdout has one line per event. Exit status 0 only when nothing was lost,
duplicated, unexpected or left open, every status is clean and no driver hung.

Run: ``.venv/bin/python dev/soak.py --kills 300 --seed 42 --report .cache/soak.json``
(``make soak KILLS=300 SEED=42``). Needs a broker (``make kafka-up``) and ``make setup``'s jars.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LINKS = ("sink", "kafka", "delta", "merge")
PIPELINES = {"sink": "sink-driver", "kafka": "kafka-driver", "delta": "delta-driver", "merge": "merge-driver"}
MERGE_KEYS = 20  # the block's changes: record n sets key n % MERGE_KEYS to n (a key's records share a partition)
POISON_EVERY = 97  # one delta-link record in POISON_EVERY is not an order (dead letter)


# --- small helpers ---------------------------------------------------------------------------------


class Log:
    """One line per event on stdout, with the seconds since the soak started."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self, message: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        print(f"{stamp} [{time.monotonic() - self.t0:8.1f}s] {message}", flush=True)


log = Log()


def percentiles(values: list[float]) -> dict[str, Any]:
    """n, min, p50, p90, max, mean (nearest rank) of values; n=0 and Nones when empty."""
    if not values:
        return {"n": 0, "min": None, "p50": None, "p90": None, "max": None, "mean": None}
    s = sorted(values)

    def rank(p: float) -> float:
        return round(s[max(0, math.ceil(p * len(s)) - 1)], 2)

    return {"n": len(s), "min": round(s[0], 2), "p50": rank(0.5), "p90": rank(0.9), "max": round(s[-1], 2),
            "mean": round(statistics.fmean(s), 2)}


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


# --- processes -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    cmd: tuple[str, ...]

    def name(self) -> str:
        """A short description: driver, jvm, daemon(<module>), worker(<module>), python(<module>)."""
        cmd = self.cmd
        if any("lastagent.examples" in c for c in cmd):
            return "driver"
        if cmd and cmd[0].endswith("java"):
            return "jvm"
        module = cmd[cmd.index("-m") + 1] if "-m" in cmd[:-1] else (cmd[0] if cmd else "?")
        if module == "pyspark.daemon":
            return f"daemon({cmd[-1]})"
        return f"python({module})"


def session_processes(sid: int) -> dict[int, Proc]:
    """Every live (non-zombie) process of the session ``sid``."""
    found: dict[int, Proc] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            raw = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if fields[0] == "Z" or int(fields[3]) != sid:
            continue
        found[int(entry)] = Proc(int(entry), int(fields[1]), tuple(raw.decode(errors="replace").split("\0")[:-1]))
    return found


def executor_workers(procs: dict[int, Proc]) -> list[Proc]:
    """Executor Python workers: children of ``pyspark.daemon pyspark.worker``, or ``-m pyspark.worker`` (daemon off).

    The driver-side Python runners (data source planning, the streaming source and sink runners) are not
    executor workers and are left alone (a driver kill takes them).
    """
    out = []
    for p in procs.values():
        parent = procs.get(p.ppid)
        if p.cmd[1:3] == ("-m", "pyspark.worker") or (p.cmd[1:] == ("-m", "pyspark.daemon", "pyspark.worker") and parent is not None
              and parent.cmd == p.cmd):
            out.append(p)
    return sorted(out, key=lambda p: p.pid)


def kill_session(sid: int) -> list[Proc]:
    """SIGKILLs every process of the session (the group and the daemons' own groups); what was killed."""
    killed: dict[int, Proc] = {}
    for _ in range(20):
        procs = session_processes(sid)
        if not procs:
            break
        for p in procs.values():
            try:
                os.kill(p.pid, signal.SIGKILL)
                killed.setdefault(p.pid, p)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    return sorted(killed.values(), key=lambda p: p.pid)


def summarize(procs: list[Proc]) -> str:
    counts: dict[str, int] = {}
    for p in procs:
        counts[p.name()] = counts.get(p.name(), 0) + 1
    return ", ".join(f"{n}x{c}" if c > 1 else n for n, c in sorted(counts.items()))


# --- the links -------------------------------------------------------------------------------------


@dataclass
class Link:
    """One link: its driver arguments, where its decisions land, its source bookkeeping."""

    kind: str
    name: str  # the link option
    args: list[str]
    decisions: Path  # the _delta_log that gets txn(appId=name) for each decided epoch (the block's: lastagent/name/gN)
    per_epoch: int  # source records per epoch
    produced: int = 0  # source records written so far
    topped_up_at: float = 0.0
    latest_epoch: int = -1
    scanned_version: int = -1
    startups: list[float] = field(default_factory=list)
    kills_before_commit: int = 0  # driver kills in a row that came before their run's first commit
    consecutive_failures: int = 0

    def decides(self, txn: dict[str, Any]) -> bool:
        """Whether a ``txn`` action is one of the link's decisions (not a claim's fence of an older generation)."""
        app, version = str(txn.get("appId")), int(txn.get("version", -1))
        if self.kind != "merge":
            return app == self.name
        return app.startswith(f"lastagent/{self.name}/g") and 0 <= version < 1 << 62

    def scan(self) -> list[tuple[int, float]]:
        """(epoch, commit time) of the link's decisions committed since the last scan."""
        try:
            names = os.listdir(self.decisions)
        except FileNotFoundError:
            return []
        versions = sorted(int(n[:20]) for n in names if len(n) == 25 and n.endswith(".json") and n[:20].isdigit())
        found = []
        for v in versions:
            if v <= self.scanned_version:
                continue
            path = self.decisions / f"{v:020d}.json"
            try:
                actions = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
                mtime = path.stat().st_mtime
            except (OSError, ValueError):
                break  # not complete yet: read it at the next scan
            self.scanned_version = v
            stamp = next((a["commitInfo"].get("timestamp") for a in actions if "commitInfo" in a), None)
            for a in actions:
                if "txn" in a and self.decides(a["txn"]):
                    epoch = int(a["txn"]["version"])
                    found.append((epoch, stamp / 1000 if stamp else mtime))
                    self.latest_epoch = max(self.latest_epoch, epoch)
        return found


class Soak:
    def __init__(self, args: argparse.Namespace, resume: dict[str, Any] | None = None) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.bootstrap = args.bootstrap
        self.run_id = resume["run_id"] if resume else f"soak-{args.seed}-{uuid.uuid4().hex[:6]}"
        self.work = Path(args.workdir).resolve() / self.run_id
        (self.work / "logs").mkdir(parents=True, exist_ok=bool(resume))
        self.report_path = Path(args.report).resolve()
        self.report_path.parent.mkdir(parents=True, exist_ok=True)
        self.links_wanted = [k.strip() for k in args.links.split(",") if k.strip()]
        self.topics = {t: f"{self.run_id}-{t}" for t in ("sink-out", "kafka-in", "kafka-out", "orders", "dead", "side",
                                                         "changes", "events")}
        w = self.work
        self.links: dict[str, Link] = {}
        names = {k: f"{self.run_id}-{k}" for k in LINKS}
        b = self.bootstrap
        self.links["sink"] = Link("sink", names["sink"], [b, str(w / "sink-source"), str(w / "sink-ckpt"), str(w / "sink-arb"),
                                                          names["sink"], self.topics["sink-out"]],
                                  w / "sink-arb" / "_delta_log", args.sink_rows)
        self.links["kafka"] = Link("kafka", names["kafka"], [b, self.topics["kafka-in"], str(w / "kafka-ckpt"), str(w / "kafka-arb"),
                                                             names["kafka"], self.topics["kafka-out"], str(args.per_trigger)],
                                   w / "kafka-arb" / "_delta_log", args.per_trigger)
        self.links["delta"] = Link("delta", names["delta"], [b, self.topics["orders"], str(w / "delta-table"), str(w / "delta-ckpt"),
                                                             names["delta"], self.topics["dead"], self.topics["side"],
                                                             str(args.per_trigger)],
                                   w / "delta-table" / "_delta_log", args.per_trigger)
        self.links["merge"] = Link("merge", names["merge"], [b, self.topics["changes"], self.topics["events"],
                                                             str(w / "merge-table"), str(w / "merge-ckpt"), names["merge"],
                                                             str(args.per_trigger)],
                                   w / "merge-table" / "_delta_log", args.per_trigger)
        self.links = {k: v for k, v in self.links.items() if k in self.links_wanted}
        self.driver_budget = args.kills - round(args.kills * args.worker_share)
        self.worker_budget = args.kills - self.driver_budget
        self.kills: list[dict[str, Any]] = []
        self.runs: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []
        self.started_wall = time.time()
        self.t0 = time.monotonic()
        self.status = "running"
        self.verification: dict[str, Any] = {}
        self.load_start = os.getloadavg()
        self._producer: Any = None
        self._daemon_off = False
        self.current_pid: int | None = None
        self.current_link: str | None = None
        self.current_record: dict[str, Any] | None = None
        self.interruptions: list[dict[str, Any]] = []
        self.elapsed_before = 0.0
        self.resumed = resume is not None
        if resume:
            self._resume(resume)

    def _resume(self, data: dict[str, Any]) -> None:
        """Takes up an interrupted soak from its report: the same sources, checkpoints, tables and kill counts.

        The RNG restarts from ``"<seed>/<runs done>"``, so a resumed soak is as reproducible as the
        interruption's point. A driver the interruption left running (the soak itself SIGKILLed) is killed first.
        """
        self.rng = random.Random(f"{self.args.seed}/{len(data['run_log'])}")
        self.kills, self.runs, self.failures = data["kill_log"], data["run_log"], data["failures"]
        self.interruptions = data.get("interruptions", [])
        self.started_wall = time.mktime(time.strptime(data["started_at"][:19], "%Y-%m-%dT%H:%M:%S"))
        self.elapsed_before = float(data["duration_s"])
        self.load_start = tuple(data["machine"]["loadavg_at_start"])  # type: ignore[assignment]
        self.driver_budget -= sum(1 for k in self.kills if k["kind"] == "driver")
        self.worker_budget -= sum(1 for k in self.kills if k["kind"] == "worker")
        for kind, link in self.links.items():
            link.produced = int(data["links"][kind]["source_records"])
            mine = [r for r in self.runs if r["link"] == kind]
            link.startups = [r["restart_to_first_commit_s"] for r in mine if r["restart_to_first_commit_s"] is not None]
            for r in reversed(mine):
                if r["outcome"] != "killed" or r["restart_to_first_commit_s"] is not None:
                    break
                link.kills_before_commit += 1
            link.scan()
        left = data.get("current_run")
        if left:
            procs = session_processes(left["pid"])
            if any(p.name() == "driver" and self.links[left["link"]].name in p.cmd for p in procs.values()):
                log(f"killing the driver the interruption left running: {summarize(kill_session(left['pid']))}")
            self.finish_decided(self.links[left["link"]])  # a SIGKILLed soak could not finish them itself
        log(f"resuming {self.run_id} after {len(self.runs)} runs and {len(self.kills)} kills "
            f"({self.driver_budget} driver and {self.worker_budget} worker kills to go)")

    # --- sources ---

    def create(self) -> None:
        from kafka.admin import KafkaAdminClient, NewTopic

        if not self.resumed:
            admin = KafkaAdminClient(bootstrap_servers=self.bootstrap, client_id="lastagent-soak")
            try:
                wanted = {"sink-out": 2, "kafka-in": 2, "kafka-out": 2, "orders": 2, "dead": 1, "side": 2,
                          "changes": 2, "events": 2}
                admin.create_topics([NewTopic(self.topics[t], n, 1) for t, n in wanted.items()])
            finally:
                admin.close()
            if "merge" in self.links:  # the block MERGEs into a table the user made with Spark
                self.spark(["--spark-sql", f"CREATE TABLE delta.`{self.links['merge'].args[3]}` "
                                           "(id BIGINT, amount BIGINT) USING delta"])
        from confluent_kafka import Producer

        self._producer = Producer({"bootstrap.servers": self.bootstrap, "enable.idempotence": True, "linger.ms": 20})
        log(f"soak {self.run_id}: workdir {self.work}, topics {sorted(self.topics.values())}")

    def top_up(self, link: Link, epochs: int | None = None) -> None:
        """Adds source records so that about ``--backlog-epochs`` epochs of work wait for the link."""
        link.scan()
        consumed = (link.latest_epoch + 1) * link.per_epoch
        backlog = max(0, link.produced - consumed)
        want = (epochs if epochs is not None else self.args.backlog_epochs) * link.per_epoch - backlog
        if want <= 0:
            return
        want = math.ceil(want / link.per_epoch) * link.per_epoch
        start = link.produced
        if link.kind == "sink":
            import pyarrow as pa
            from deltalake import write_deltalake

            for c in range(start // link.per_epoch, (start + want) // link.per_epoch):
                ids = [f"s-{c * link.per_epoch + i}" for i in range(link.per_epoch)]
                write_deltalake(link.args[1], pa.table({"key": ids, "value": ids}), mode="append")
        else:
            topic = self.topics[{"kafka": "kafka-in", "delta": "orders", "merge": "changes"}[link.kind]]
            for n in range(start, start + want):
                key, value = self.source_record(link.kind, n)
                self._producer.produce(topic, key=key.encode(), value=value.encode(), partition=n % 2)
                if n % 1000 == 999:
                    self._producer.poll(0)
            left = self._producer.flush(60)
            if left:
                raise RuntimeError(f"producer: {left} records not delivered within 60 s")
        link.produced = start + want
        link.topped_up_at = time.time()
        log(f"source {link.kind}: +{want} records (now {link.produced}; estimated backlog before: {backlog})")

    @staticmethod
    def source_record(kind: str, n: int) -> tuple[str, str]:
        if kind == "sink":
            return f"s-{n}", f"s-{n}"
        if kind == "kafka":
            return f"k-{n}", f"k-{n}"
        if kind == "merge":
            return f"m-{n}", json.dumps({"id": n % MERGE_KEYS, "amount": n})
        value = f"poison-{n}" if n % POISON_EVERY == POISON_EVERY // 2 else f"order-{n // 1000}-{n % 1000}"
        return f"d-{n}", value

    # --- one driver run ---

    def horizon(self, link: Link) -> float:
        """factor x the link's median of its last 5 restart->first-commit times (``--initial-horizon`` before the
        first), stretched by 1.25 for every driver kill in a row that came before the run's first commit, so a
        slow machine still gets kills among epochs (the link makes progress)."""
        recent = link.startups[-5:]
        base = self.args.horizon_factor * statistics.median(recent) if recent else self.args.initial_horizon
        return max(self.args.min_horizon, base) * 1.25 ** link.kills_before_commit

    def plan(self, link: Link, drain: bool) -> tuple[float | None, list[float], float]:
        """(driver kill time or None, worker kill times, horizon) for the next run, from the seeded RNG."""
        horizon = self.horizon(link)
        # Drawn every run, in one order, so that the sequence depends on the seed only.
        u_driver = self.rng.uniform(0.1, 1.0)
        # 1..N worker kills, uniform; for N = 2 the draws are those of the first recorded soaks.
        most = self.args.worker_kills_per_run
        n_workers = most - int(self.rng.random() * most)
        u_workers = sorted(self.rng.uniform(0.1, 1.0) for _ in range(most))[:n_workers]
        daemon_off = self.rng.random() < self.args.daemon_off_share
        self._daemon_off = daemon_off
        if drain:
            return None, [], horizon
        driver_at = horizon * u_driver if self.driver_budget > 0 else None
        span = driver_at if driver_at is not None else horizon
        workers = [span * u for u in u_workers][:self.worker_budget] if self.worker_budget > 0 else []
        return driver_at, workers, horizon

    def run(self, link: Link, drain: bool = False) -> dict[str, Any]:
        driver_at, worker_times, horizon = self.plan(link, drain)
        daemon_off = self._daemon_off
        number = len(self.runs) + 1
        link.scan()
        before_epoch = link.latest_epoch
        local_dir = self.work / "spark-local" / link.kind
        local_dir.mkdir(parents=True, exist_ok=True)
        conf = {"spark.local.dir": str(local_dir)}
        if daemon_off:
            conf["spark.python.use.daemon"] = "false"
        env = dict(os.environ, LASTAGENT_SPARK_MASTER=self.args.master,
                   LASTAGENT_SPARK_CONF=";".join(f"{k}={v}" for k, v in conf.items()))
        for var in ("LASTAGENT_CRASH_AT", "LASTAGENT_CRASH_STATE", "LASTAGENT_KAFKA_CONFIG"):
            env.pop(var, None)
        stderr_path = self.work / "logs" / f"run-{number:04d}-{link.kind}.log"
        started_wall = time.time()
        t_start = time.monotonic()
        with open(stderr_path, "ab") as err:
            proc = subprocess.Popen([sys.executable, "-m", "lastagent.examples", PIPELINES[link.kind], *link.args],
                                    env=env, start_new_session=True, preexec_fn=_unblock_signals,  # noqa: PLW1509 — the soak starts no thread before this
                                    stdout=err,
                                    stderr=subprocess.STDOUT, cwd=self.work)
        self.current_pid, self.current_link = proc.pid, link.kind
        self.save()
        plan_text = (f"driver kill at {driver_at:.1f}s" if driver_at is not None else "no driver kill")
        if worker_times:
            plan_text += ", worker kills from " + ", ".join(f"{t:.1f}s" for t in worker_times)
        log(f"run {number} {link.kind}: started pid {proc.pid} ({'drain, ' if drain else ''}daemon "
            f"{'off' if daemon_off else 'on'}, horizon {horizon:.0f}s, {plan_text})")
        record: dict[str, Any] = {"run": number, "link": link.kind, "drain": drain, "pid": proc.pid,
                                  "daemon": "off" if daemon_off else "on", "started_at": started_wall,
                                  "planned_driver_kill_s": driver_at, "planned_worker_kills_s": worker_times,
                                  "worker_kills": [], "log": str(stderr_path)}
        self.current_record = record
        first: tuple[int, float] | None = None
        epochs = 0
        pending = list(worker_times)
        outcome = None
        code: int | None = None
        next_scan = next_look = 0.0
        timeout = self.args.run_timeout
        while True:
            now = time.monotonic() - t_start
            code = proc.poll()
            if code is not None:
                outcome = "finished" if code == 0 else "failed"
                break
            if now >= next_scan:
                next_scan = now + 0.5
                for epoch, stamp in link.scan():
                    epochs += 1
                    if first is None:
                        first = (epoch, stamp - started_wall)
                        record.update({"first_commit_epoch": epoch, "restart_to_first_commit_s": round(first[1], 2)})
                        log(f"run {number} {link.kind}: first commit epoch {epoch} at {first[1]:.1f}s after start")
            if pending and now >= pending[0] and self.worker_budget > 0 and now >= next_look:
                next_look = now + 0.25
                workers = executor_workers(session_processes(proc.pid))
                if workers:
                    victim = workers[self.rng.randrange(len(workers))]
                    try:
                        os.kill(victim.pid, signal.SIGKILL)
                        alive = True
                    except ProcessLookupError:
                        alive = False  # it ended on its own: try again at the next round
                    if alive:
                        pending.pop(0)
                        self.worker_budget -= 1
                        kill = self._kill("worker", link, number, now, f"pid {victim.pid} {victim.name()} "
                                          f"(1 of {len(workers)} executor workers)", daemon_off)
                        record["worker_kills"].append(kill)
            if driver_at is not None and now >= driver_at and self.driver_budget > 0:
                killed = kill_session(proc.pid)
                code = proc.wait(timeout=60)
                self.driver_budget -= 1
                kill = self._kill("driver", link, number, now, f"{len(killed)} processes: {summarize(killed)}",
                                  daemon_off, before_first_commit=first is None)
                record["driver_kill"] = kill
                outcome = "killed"
                break
            if now > timeout:
                killed = kill_session(proc.pid)
                code = proc.wait(timeout=60)
                outcome = "hung"
                log(f"run {number} {link.kind}: HUNG past {timeout:.0f}s; killed {summarize(killed)}")
                break
            time.sleep(0.1)
        leftovers = kill_session(proc.pid)  # a finished driver's daemons normally leave with its JVM
        for epoch, stamp in link.scan():
            epochs += 1
            if first is None and stamp <= time.time():
                first = (epoch, stamp - started_wall)
        shutil.rmtree(local_dir, ignore_errors=True)
        duration = time.monotonic() - t_start
        record.update({"outcome": outcome, "exit": code, "duration_s": round(duration, 2), "epochs_committed": epochs,
                       "epoch_before": before_epoch, "epoch_after": link.latest_epoch,
                       "first_commit_epoch": first[0] if first else None,
                       "restart_to_first_commit_s": round(first[1], 2) if first else None,
                       "leftover_processes": summarize(leftovers) if leftovers else ""})
        if first is not None:
            link.startups.append(first[1])
            link.kills_before_commit = 0
        elif outcome == "killed":
            link.kills_before_commit += 1
        if outcome in ("failed", "hung"):
            link.consecutive_failures += 1
            tail = stderr_path.read_text(errors="replace").splitlines()[-40:]
            record["stderr_tail"] = tail
            self.failures.append({"run": number, "link": link.kind, "outcome": outcome, "exit": code,
                                  "after_worker_kills": len(record["worker_kills"]), "log": str(stderr_path),
                                  "error": _error_line(tail)})
        else:
            link.consecutive_failures = 0
        error = f", ERROR: {_error_line(record['stderr_tail'])}" if "stderr_tail" in record else ""
        log(f"run {number} {link.kind}: {outcome} (exit {code}) after {duration:.1f}s, {epochs} epochs committed "
            f"(latest {link.latest_epoch}), first commit {f'{first[1]:.1f}s' if first else 'none'}{error}")
        self.runs.append(record)
        self.current_pid = self.current_link = self.current_record = None
        return record

    def _kill(self, kind: str, link: Link, run: int, at: float, what: str, daemon_off: bool,
              before_first_commit: bool | None = None) -> dict[str, Any]:
        kill = {"n": len(self.kills) + 1, "kind": kind, "link": link.kind, "run": run, "at_s": round(at, 2),
                "daemon": "off" if daemon_off else "on", "what": what}
        if before_first_commit is not None:
            kill["before_first_commit"] = before_first_commit
        self.kills.append(kill)
        log(f"KILL #{kill['n']} {kind} link={link.kind} run={run} t=+{at:.1f}s: {what}")
        self.save()
        return kill

    # --- the soak ---

    def soak(self) -> None:
        order = [self.links[k] for k in LINKS if k in self.links]
        i = len(self.runs)  # round-robin goes on where an interrupted soak stopped
        # (A goal lowered on --resume ends here even when one kind's share is not used up.)
        while (self.driver_budget > 0 or self.worker_budget > 0) and len(self.kills) < self.args.kills:
            if self.elapsed() > self.args.max_hours * 3600:
                raise SoakAbort(f"--max-hours {self.args.max_hours} reached with {len(self.kills)} kills done")
            link = order[i % len(order)]
            i += 1
            self.top_up(link)
            self.run(link)
            self.save()
            if link.consecutive_failures >= self.args.max_failures:
                raise SoakAbort(f"link {link.kind} failed {link.consecutive_failures} runs in a row")
        log(f"all {len(self.kills)} kills done; every link runs to its end without kills")
        for link in order:
            for _attempt in range(self.args.max_failures):
                record = self.run(link, drain=True)
                self.save()
                if record["outcome"] == "finished":
                    break
            else:
                raise SoakAbort(f"link {link.kind} did not finish cleanly in {self.args.max_failures} runs")

    # --- verification ---

    def verify(self) -> None:
        v: dict[str, Any] = {"links": {}}
        lost = duplicated = unexpected = open_txns = orphans = 0
        status_exit: dict[str, int | None] = {}
        for kind, link in self.links.items():
            expected = [self.source_record(kind, n) for n in range(link.produced)]
            checks: dict[str, Any] = {}
            if kind in ("sink", "kafka"):
                values = self.read_committed(self.topics[f"{kind}-out"], lambda k, val: val)
                checks["output_topic"] = compare([val for _, val in expected], values)
            elif kind == "merge":
                checks["events_topic"] = compare([str(n) for n in range(link.produced)],
                                                 self.read_committed(self.topics["events"],
                                                                     lambda k, val: str(json.loads(val)["amount"])))
                last = {n % MERGE_KEYS: n for n in range(link.produced)}
                rows = {r["id"]: r["amount"] for r in self.spark_rows(link.args[3])}
                checks["merge_table"] = {"keys": len(rows), "lost": 0, "duplicated": 0,
                                         "unexpected": sum(1 for k, v in rows.items() if last.get(k) != v)
                                         + sum(1 for k in last if k not in rows)}
            else:
                good = [k for k, val in expected if not val.startswith("poison-")]
                poison = [k for k, val in expected if val.startswith("poison-")]
                checks["delta_table"] = compare(good, [r["key"] for r in self.spark_rows(str(self.work / "delta-table"))])
                checks["side_topic"] = compare(good, self.read_committed(self.topics["side"],
                                                                         lambda k, val: json.loads(val)["key"]))
                checks["dead_letters"] = compare(poison, self.read_committed(self.topics["dead"], lambda k, val: k))
                checks["orphan_files"] = self.orphan_files(self.work / "delta-table")
                orphans += len(checks["orphan_files"])
            from lastagent.kafka.xa import KafkaXAResource

            with KafkaXAResource({"bootstrap.servers": self.bootstrap}) as xa:
                still_open = xa.recover(f"lastagent-{link.name}-")
            checks["open_transactions"] = [t.transactional_id for t in still_open]
            open_txns += len(still_open)
            status_exit[kind], checks["status"] = self.status_of(link)
            for c in checks.values():
                if isinstance(c, dict) and "lost" in c:
                    lost += c["lost"]
                    duplicated += c["duplicated"]
                    unexpected += c["unexpected"]
            checks["source_records"] = link.produced
            checks["epochs_decided"] = link.latest_epoch + 1
            v["links"][kind] = checks
        v.update({"lost": lost, "duplicated": duplicated, "unexpected": unexpected, "open_transactions": open_txns,
                  "orphan_files": orphans, "status_exit": status_exit,
                  "status_clean": all(c == 0 for c in status_exit.values())})
        self.verification = v
        log(f"verification: lost {lost}, duplicated {duplicated}, unexpected {unexpected}, open transactions "
            f"{open_txns}, orphan files {orphans}, lastagent status exit {status_exit}")

    def read_committed(self, topic: str, pick: Any) -> list[str]:
        """pick(key, value) of every record in topic, read to its end by an independent read_committed consumer."""
        from confluent_kafka import Consumer, KafkaError, TopicPartition

        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": f"soak-verify-{uuid.uuid4().hex}",
                             "isolation.level": "read_committed", "auto.offset.reset": "earliest",
                             "enable.auto.commit": False, "enable.partition.eof": True})
        try:
            partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
            consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
            at_end: set[int] = set()
            out: list[str] = []
            deadline = time.monotonic() + self.args.verify_timeout
            while len(at_end) < len(partitions):
                if time.monotonic() > deadline:
                    raise SoakAbort(f"reading {topic}: partitions {sorted(set(partitions) - at_end)} not read to their "
                                    f"end within {self.args.verify_timeout:.0f}s")
                for msg in consumer.consume(1000, 0.5):
                    err = msg.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            at_end.add(msg.partition())
                            continue
                        raise SoakAbort(f"reading {topic}: {err}")
                    at_end.discard(msg.partition())
                    key = msg.key().decode() if msg.key() is not None else None
                    value = msg.value().decode(errors="replace") if msg.value() is not None else None
                    out.append(pick(key, value))
            return out
        finally:
            consumer.close()

    def spark_rows(self, table: str) -> list[dict[str, Any]]:
        """The rows of a Delta table, read by Spark's Delta reader (a local session, in a process of its own)."""
        out = self.work / "delta-rows.json"
        self.spark(["--spark-read", table, str(out)])
        return json.loads(out.read_text())

    def spark(self, what: list[str]) -> None:
        """Runs this file's ``--spark-read`` or ``--spark-sql`` in a process of its own."""
        env = dict(os.environ)
        env.pop("LASTAGENT_SPARK_CONF", None)
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *what, "--workdir", str(self.work)],
                              env=env, capture_output=True, text=True, preexec_fn=_unblock_signals,
                              timeout=self.args.verify_timeout, check=False)
        if proc.returncode != 0:
            raise SoakAbort(f"{what[0]} {what[1]} with Spark failed (exit {proc.returncode}): {proc.stderr[-2000:]}")

    @staticmethod
    def orphan_files(table: Path) -> list[str]:
        """Data files the link wrote that no commit of the table references."""
        from deltalake import DeltaTable

        from lastagent.delta.files import parse_file_name

        referenced = {Path(p).name for p in DeltaTable(str(table)).file_uris()}
        return sorted(p.name for p in table.rglob("*.parquet") if parse_file_name(p.name) and p.name not in referenced)

    def _where(self, link: Link) -> list[str]:
        """The ``lastagent`` command's options that name the link's arbitration store."""
        return (["--table", link.args[2]] if link.kind == "delta" else ["--table", link.args[3]] if link.kind == "merge"
                else ["--arbitration-table", link.args[3]])

    def finish_decided(self, link: Link) -> list[str]:
        """Commits the link's decided branches that a stopped driver left open, with ``lastagent recover --commit``.

        An interruption stops the running driver like a driver kill, but the soak may then pause longer than the
        branches' ``transaction.timeout.ms`` (a session ends; the broker stops with it): a decided branch would
        expire, and the link would stop on the expired-decided hazard, as it must. An operator who stops a query
        for long finishes its decided branches first; so does the soak. Undecided branches stay (the next run
        rolls them back). Returns the ids committed.
        """
        base = [sys.executable, "-m", "lastagent.cli"]
        where = [*self._where(link), "--bootstrap-servers", self.bootstrap]
        status = subprocess.run([*base, "status", "--link", link.name, *where, "--json"], capture_output=True,
                                text=True, timeout=300, preexec_fn=_unblock_signals, check=False)
        try:
            decided = [b["transactional_id"] for b in json.loads(status.stdout)["in_doubt"] if b["decision"] == "commit"]
        except (ValueError, KeyError) as exc:
            log(f"finishing {link.kind}'s decided branches: status unreadable ({exc}): {status.stderr[-500:]}")
            return []
        if decided:
            done = subprocess.run([*base, "recover", "--link", link.name, *where, "--commit", *decided], capture_output=True,
                                  text=True, timeout=300, preexec_fn=_unblock_signals, check=False)
            log(f"finished {link.kind}'s decided branches {decided}: exit {done.returncode} {done.stdout.strip()[-300:]}")
        return decided

    def status_of(self, link: Link) -> tuple[int | None, Any]:
        cmd = [sys.executable, "-m", "lastagent.cli", "status", "--link", link.name, *self._where(link),
               "--bootstrap-servers", self.bootstrap, "--json"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, preexec_fn=_unblock_signals, check=False)
        except subprocess.TimeoutExpired:
            return None, "timed out"
        try:
            body: Any = json.loads(proc.stdout)
            body = {k: body[k] for k in ("decided_epochs", "latest_decided_epoch", "confirmed_through", "in_doubt",
                                         "hazards", "arbitration_rows", "arbitration_files") if k in body}
        except ValueError:
            body = (proc.stdout + proc.stderr)[-2000:]
        return proc.returncode, body

    # --- the report ---

    def report(self) -> dict[str, Any]:
        by_link: dict[str, dict[str, int]] = {k: {"driver": 0, "worker": 0} for k in self.links}
        for k in self.kills:
            by_link[k["link"]][k["kind"]] += 1
        driver_kills = [k for k in self.kills if k["kind"] == "driver"]
        finished_runs = [r for r in self.runs if r.get("outcome")]
        firsts = [r["restart_to_first_commit_s"] for r in finished_runs if r["restart_to_first_commit_s"] is not None]
        after_kill = [r["restart_to_first_commit_s"] for i, r in enumerate(finished_runs)
                      if r["restart_to_first_commit_s"] is not None and self._previous_killed(i)]
        outcomes: dict[str, int] = {}
        for r in finished_runs:
            outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
        v = self.verification
        return {
            "status": self.status,
            "seed": self.args.seed,
            "kills_wanted": self.args.kills,
            "run_id": self.run_id,
            "bootstrap": self.bootstrap,
            "workdir": str(self.work),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started_wall)),
            "duration_s": round(self.elapsed(), 1),
            "interruptions": self.interruptions,
            "current_run": {"pid": self.current_pid, "link": self.current_link} if self.current_pid else None,
            "parameters": {k: v_ for k, v_ in vars(self.args).items() if k not in ("spark_read", "spark_sql")},
            "machine": {"cpus": os.cpu_count(), "loadavg_at_start": self.load_start, "loadavg_now": os.getloadavg()},
            "kills": {"total": len(self.kills), "by_kind": {"driver": len(driver_kills),
                                                            "worker": len(self.kills) - len(driver_kills)},
                      "by_link": by_link,
                      "driver_kills_before_first_commit": sum(1 for k in driver_kills if k.get("before_first_commit"))},
            "kill_times_s": {"driver": percentiles([k["at_s"] for k in driver_kills]),
                             "worker": percentiles([k["at_s"] for k in self.kills if k["kind"] == "worker"])},
            "restart_to_first_commit_s": {
                "all_runs": percentiles(firsts), "after_a_driver_kill": percentiles(after_kill),
                "by_link": {k: percentiles([r["restart_to_first_commit_s"] for r in finished_runs
                                            if r["link"] == k and r["restart_to_first_commit_s"] is not None])
                            for k in self.links}},
            "runs": {"total": len(finished_runs), "by_outcome": outcomes,
                     "daemon_off": sum(1 for r in finished_runs if r["daemon"] == "off"),
                     "without_a_commit": sum(1 for r in finished_runs if r["restart_to_first_commit_s"] is None)},
            "links": {k: {"link": link.name, "source_records": link.produced, "latest_epoch": link.latest_epoch,
                          "args": link.args} for k, link in self.links.items()},
            "lost": v.get("lost"), "duplicated": v.get("duplicated"), "unexpected": v.get("unexpected"),
            "open_transactions": v.get("open_transactions"), "orphan_files": v.get("orphan_files"),
            "status_clean": v.get("status_clean"),
            "verification": v,
            "failures": self.failures,
            "kill_log": self.kills,
            "run_log": self.runs,
        }

    def _previous_killed(self, index: int) -> bool:
        """Whether the previous run of the same link ended in a driver kill (so this run is a restart after one)."""
        link = self.runs[index]["link"]
        for r in reversed(self.runs[:index]):
            if r["link"] == link:
                return r.get("outcome") == "killed"
        return False

    def elapsed(self) -> float:
        """Seconds the soak has run, over all its sessions (an interruption's pause not included)."""
        return self.elapsed_before + time.monotonic() - self.t0

    def save(self) -> dict[str, Any]:
        data = self.report()
        write_json(self.report_path, data)
        return data

    def passed(self) -> bool:
        v = self.verification
        return (bool(v) and v["lost"] == 0 and v["duplicated"] == 0 and v["unexpected"] == 0
                and v["open_transactions"] == 0 and v["orphan_files"] == 0 and v["status_clean"]
                and not any(f["outcome"] == "hung" for f in self.failures))

    def stop_current(self, finish: bool = False) -> None:
        """Stops the running driver; with ``finish``, then commits the decided branches it left open."""
        if self.current_pid is not None:
            killed = kill_session(self.current_pid)
            if killed:
                log(f"stopped the running driver: {summarize(killed)}")
            if finish and self.current_link is not None:
                self.finish_decided(self.links[self.current_link])
            if self.current_record is not None:
                # Kept, so the kills it holds keep their run; not counted as a kill.
                self.current_record.update({"outcome": "interrupted", "exit": None, "leftover_processes": summarize(killed)})
                self.current_record.setdefault("restart_to_first_commit_s", None)
                self.current_record.setdefault("first_commit_epoch", None)
                self.runs.append(self.current_record)
            self.current_pid = self.current_link = self.current_record = None




class SoakAbort(Exception):
    """The soak cannot go on (a link keeps failing, a driver hung, a read timed out); reported as a failure."""


def compare(expected: list[str], seen: list[str]) -> dict[str, Any]:
    """lost / duplicated / unexpected counts of seen against expected (each expected once)."""
    want = set(expected)
    counts: dict[str, int] = {}
    for s in seen:
        counts[s] = counts.get(s, 0) + 1
    lost = sorted(want - set(counts))
    dups = {k: c for k, c in counts.items() if c > 1}
    extra = sorted(k for k in counts if k not in want)
    return {"expected": len(want), "seen": len(seen), "lost": len(lost), "duplicated": sum(c - 1 for c in dups.values()),
            "unexpected": len(extra), "lost_sample": lost[:20], "duplicated_sample": sorted(dups)[:20],
            "unexpected_sample": extra[:20]}


STOP_SIGNALS = {signal.SIGTERM, signal.SIGHUP}


def _unblock_signals() -> None:
    """In a child before exec: the signals the soak's watcher thread takes are delivered again."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _describe_pid(pid: int, depth: int = 3) -> str:
    """pid, session, working directory and command line of a process and its parents (who sent a signal)."""
    parts = []
    for _ in range(depth):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rfind(")") + 2:].split()
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            parts.append(f"pid {pid} (gone)")
            break
        parts.append(f"pid {pid} sid {fields[3]} cwd {cwd}: {cmd[:200]}")
        pid = int(fields[1])
        if pid <= 1:
            break
    return " <- ".join(parts)


def watch_stop_signals(on_stop: Any) -> None:
    """Takes SIGTERM/SIGHUP in a thread with ``sigwaitinfo``, so the sender is known: ``on_stop(text)``, then
    the main thread is interrupted (KeyboardInterrupt). Must be called before any other thread starts."""
    import _thread
    import threading

    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    # A shell's background job starts with SIGINT ignored, and interrupt_main() does nothing then.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def loop() -> None:
        info = signal.sigwaitinfo(STOP_SIGNALS)
        on_stop(f"{signal.Signals(info.si_signo).name} from {_describe_pid(info.si_pid)} (uid {info.si_uid})")
        _thread.interrupt_main()

    threading.Thread(target=loop, name="stop-signals", daemon=True).start()


def _error_line(tail: list[str]) -> str:
    """The most telling line of a failed driver's output (the last exception line)."""
    for line in reversed(tail):
        if "Error" in line or "Exception" in line:
            return line.strip()[:400]
    return (tail[-1].strip()[:400] if tail else "")


def spark_read(table: str | None, out: str | None, sql: str | None, workdir: str) -> int:
    """``--spark-read``: writes a Delta table's rows, read with Spark's Delta reader, as JSON; ``--spark-sql``: runs
    one statement."""
    from lastagent.spark_session import local_session

    local = Path(workdir) / "spark-local" / "verify"
    local.mkdir(parents=True, exist_ok=True)
    spark = local_session("lastagent-soak-verify", extra_conf={"spark.local.dir": str(local)})
    spark.sparkContext.setLogLevel("ERROR")
    if sql:
        spark.sql(sql)
    if table and out:
        rows = [r.asDict() for r in spark.read.format("delta").load(table).collect()]
        Path(out).write_text(json.dumps(rows, default=str))  # the delta link's table has timestamps and bytes
    spark.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, help="kills in all (driver + worker), default 9; with --resume, a new goal (one "
                                             "already reached ends the soak with its verification)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--report", default=str(ROOT / ".cache" / "soak.json"), help="report JSON, rewritten after every run")
    p.add_argument("--bootstrap", default=os.environ.get("LASTAGENT_KAFKA_BOOTSTRAP", "127.0.0.1:39092"))
    p.add_argument("--workdir", default=str(ROOT / ".cache" / "soak"), help="tables, checkpoints and driver logs go below")
    p.add_argument("--links", default=",".join(LINKS), help="comma-separated subset of sink,kafka,delta,merge")
    p.add_argument("--worker-share", type=float, default=0.5, help="share of the kills that hit executor Python workers")
    p.add_argument("--worker-kills-per-run", type=int, default=2,
                   help="at most this many executor worker kills per driver run (1..N, uniform)")
    p.add_argument("--daemon-off-share", type=float, default=0.3, help="share of runs with Spark's Python daemon off")
    p.add_argument("--master", default="local[2,64]", help="Spark master of the drivers (task retries after a worker kill)")
    p.add_argument("--initial-horizon", type=float, default=90.0,
                   help="seconds: driver kills land in U(0.1,1) x horizon until the link has start-up times")
    p.add_argument("--horizon-factor", type=float, default=2.0, help="horizon = factor x median restart->first commit")
    p.add_argument("--min-horizon", type=float, default=20.0)
    p.add_argument("--backlog-epochs", type=int, default=40, help="epochs of source data kept waiting per link")
    p.add_argument("--per-trigger", type=int, default=100, help="maxOffsetsPerTrigger of the Kafka-sourced links")
    p.add_argument("--sink-rows", type=int, default=50, help="rows per source commit (= per epoch) of the sink link")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="a driver running longer has hung: a failure")
    p.add_argument("--verify-timeout", type=float, default=600.0)
    p.add_argument("--max-failures", type=int, default=5, help="consecutive failed runs of a link that end the soak")
    p.add_argument("--max-hours", type=float, default=48.0)
    p.add_argument("--resume", metavar="REPORT",
                   help="take up an interrupted soak from its report (its parameters; other options but --kills are ignored)")
    p.add_argument("--spark-read", nargs=2, metavar=("TABLE", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--spark-sql", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.spark_read or args.spark_sql:
        table, out = args.spark_read or (None, None)
        return spark_read(table, out, args.spark_sql, args.workdir)
    if args.worker_kills_per_run < 1:
        p.error(f"--worker-kills-per-run: {args.worker_kills_per_run}; it must be 1 or more")
    unknown = set(args.links.split(",")) - set(LINKS)
    if unknown:
        p.error(f"--links: unknown {sorted(unknown)}")

    resume = None
    if args.resume:
        resume = json.loads(Path(args.resume).read_text())
        if resume["status"] not in ("running", "interrupted"):
            p.error(f"--resume: {args.resume} is a finished soak (status {resume['status']})")
        kept = {k: v for k, v in resume["parameters"].items() if k in vars(args) and k != "resume"}
        if args.kills is not None:
            kept["kills"] = args.kills
        args = argparse.Namespace(**{**vars(args), **kept, "report": args.resume, "resume": args.resume})
    elif args.kills is None:
        args.kills = 9
    soak = Soak(args, resume)
    log(f"soak: seed {args.seed}, {args.kills} kills ({soak.driver_budget} driver, {soak.worker_budget} worker), "
        f"links {list(soak.links)}, report {soak.report_path}")

    stopped_by: list[str] = []

    def on_stop(text: str) -> None:
        stopped_by.append(text)
        log(f"soak: {text}")

    watch_stop_signals(on_stop)
    try:
        soak.create()
        soak.save()
        soak.soak()
        soak.verify()
        soak.status = "passed" if soak.passed() else "failed"
    except KeyboardInterrupt as exc:  # SIGINT, or SIGTERM/SIGHUP through watch_stop_signals
        # Not a verdict on the connector: the run's driver is stopped (not counted as a kill), its decided branches
        # finished, and the soak can go on with --resume.
        soak.stop_current(finish=True)
        soak.status = "interrupted"
        soak.interruptions.append({"at_s": round(soak.elapsed(), 1), "after_runs": len(soak.runs),
                                   "after_kills": len(soak.kills), "why": "; ".join(stopped_by) or str(exc) or "SIGINT",
                                   "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        why = "; ".join(stopped_by) or exc or "SIGINT"
        log(f"soak INTERRUPTED ({why}); go on with: {sys.executable} {__file__} --resume {soak.report_path}")
    except SoakAbort as exc:
        soak.stop_current()
        soak.status = "failed"
        soak.failures.append({"outcome": "aborted", "error": str(exc)})
        log(f"soak ABORTED: {exc}")
    finally:
        data = soak.save()
    print_summary(data)
    return 0 if soak.status == "passed" else 1


def print_summary(d: dict[str, Any]) -> None:
    k, t, f = d["kills"], d["kill_times_s"], d["restart_to_first_commit_s"]

    def dist(x: dict[str, Any]) -> str:
        return f"n={x['n']} min {x['min']} p50 {x['p50']} p90 {x['p90']} max {x['max']}"

    print(f"""
soak {d['run_id']}: {d['status'].upper()}   seed {d['seed']}   duration {d['duration_s'] / 60:.1f} min
  kills: {k['total']} ({k['by_kind']['driver']} driver, {k['by_kind']['worker']} worker)  by link: {json.dumps(k['by_link'])}
  driver kill times after start (s): {dist(t['driver'])}
  worker kill times after start (s): {dist(t['worker'])}
  restart -> first committed epoch (s): {dist(f['all_runs'])}; after a driver kill: {dist(f['after_a_driver_kill'])}
  runs: {d['runs']['total']} {json.dumps(d['runs']['by_outcome'])}, daemon off in {d['runs']['daemon_off']}
  lost {d['lost']}, duplicated {d['duplicated']}, unexpected {d['unexpected']}, open transactions {d['open_transactions']}, \
orphan files {d['orphan_files']}, lastagent status clean: {d['status_clean']}
  interruptions (not kills; resumed with --resume): {len(d.get('interruptions') or [])}
  failures: {len(d['failures'])}{''.join(chr(10) + '    ' + json.dumps(x)[:300] for x in d['failures'][-10:])}
  report: {d['parameters']['report']}""", flush=True)


if __name__ == "__main__":
    sys.exit(main())
