# lastagent — every target does its own set-up on a fresh machine.
#   make run   the demo on a local Kafka broker and local Delta paths
#   make test  every test tier (unit, integration, chaos) on a real broker and real Spark

PY        ?= python3
VENV      := .venv
PYTHON    := $(VENV)/bin/python
PIP       := $(VENV)/bin/pip
PYTEST    := $(PYTHON) -m pytest
SOURCES   := $(shell find connector sources sinks -name '*.py' -o -name '*.pyi' 2>/dev/null) pyproject.toml \
             native/Cargo.toml native/Cargo.lock $(wildcard native/src/*.rs)
LOG       := .cache/setup.log
TEST_JVM  := .cache/spark/cds/.complete

# Portable wheels (docs/install.md): manylinux_2_28, cp310-abi3, for each of WHEEL_ARCHS, into dist/, without
# Docker: cargo-zigbuild and zig (from PyPI) as C compiler and linker against glibc 2.28, OpenSSL and zlib built
# from source and linked in statically (native/ feature `portable`); checked by auditwheel show. make setup builds
# this machine's wheel and installs it, so the tests, the demo and users run the same extension. 10 to 16 minutes
# per architecture on a 2-core machine the first time (Delta Kernel's stack; OpenSSL and librdkafka from source);
# cargo's target dir is ~/.cache/lastagent/wheel-target (LASTAGENT_CARGO_TARGET_DIR), shared by every clone on the
# machine as pip's and Maven's caches are, and after that only what changed is rebuilt (from a new clone:
# lastagent's own crate, 1 to 2 minutes). Needs cargo, and rustup's standard library for each other architecture
# (rustup target add aarch64-unknown-linux-gnu).
HOST_ARCH   := $(shell uname -m)
WHEEL_ARCHS ?= x86_64 aarch64
# The wheel tools' virtualenv sits beside cargo's target dir, shared by every clone: cargo-zigbuild names its C
# wrappers (and so the linker cargo fingerprints) by the path of the zig it runs, so a per-clone path would
# rebuild every crate in each new clone.
LASTAGENT_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/lastagent
WHEEL_TOOLS := $(LASTAGENT_CACHE)/wheel-tools
export LASTAGENT_WHEEL_TOOLS := $(WHEEL_TOOLS)
export LASTAGENT_CARGO_TARGET_DIR ?= $(LASTAGENT_CACHE)/wheel-target
NO_CARGO    := echo "setup: cargo not found: lastagent's Kafka path (native/) is Rust; install a toolchain with rustup (https://rustup.rs)"

.PHONY: setup wheels aarch64-python run test check test-unit test-integration test-chaos test-chaos-full test-wheel test-spark-versions test-kafka-versions test-cluster test-kafka-cluster test-connect test-notebook test-soak soak bench-long-run lint kafka-up kafka-down kafka-up-secured kafka-down-secured kafka-up-cluster kafka-down-cluster s3-up s3-down bench clean docs

setup: $(VENV)/.installed .cache/kafka/jars/.complete .cache/spark/jars/.complete .cache/s3/jars/.complete \
       .cache/spark/s3a-jars/.complete

# Python packages, pinned in pyproject.toml (dev/requirements.py lists them; the package itself is not built here).
$(VENV)/.deps: pyproject.toml dev/requirements.py
	@mkdir -p .cache
	@test -x $(PYTHON) || $(PY) -m venv $(VENV)
	@echo "setup: installing Python packages into $(VENV) (log: $(LOG))"
	@$(PIP) install -q --upgrade pip >>$(LOG) 2>&1
	@$(PYTHON) dev/requirements.py spark connect test > .cache/requirements.txt
	@$(PIP) install -q -r .cache/requirements.txt >>$(LOG) 2>&1 || (tail -30 $(LOG); exit 1)
	@touch $@

# The package itself: this machine's portable wheel (as make wheels builds it) installed, not editable, so that
# Spark's worker finds the top-level pyspark_lastagent_* modules by scanning sys.path; rebuilt when code changes.
$(VENV)/.installed: $(VENV)/.deps $(WHEEL_TOOLS)/.installed dev/build_wheels.py $(SOURCES)
	@command -v cargo >/dev/null || { $(NO_CARGO); exit 1; }
	@echo "setup: building lastagent's portable wheel for $(HOST_ARCH) into dist/ and installing it (log: $(LOG))"
	@$(WHEEL_TOOLS)/bin/python dev/build_wheels.py --arch $(HOST_ARCH) --out dist --install-into $(PYTHON) >>$(LOG) 2>&1 \
	  || (tail -30 $(LOG); exit 1)
	@touch $@

wheels: $(WHEEL_TOOLS)/.installed
	@command -v cargo >/dev/null || { $(NO_CARGO); exit 1; }
	@for arch in $(WHEEL_ARCHS); do \
	  rustc --print sysroot | xargs -I{} test -d {}/lib/rustlib/$$arch-unknown-linux-gnu/lib || rustup target add $$arch-unknown-linux-gnu \
	    || { echo "wheels: no Rust standard library for $$arch (rustup target add $$arch-unknown-linux-gnu failed)"; exit 1; }; \
	done
	$(WHEEL_TOOLS)/bin/python dev/build_wheels.py $(addprefix --arch ,$(WHEEL_ARCHS)) --out dist

# An arm64 CPython 3.11 (Debian's packages) and qemu-user-static in .cache/aarch64-python, nothing installed on the
# machine: tests/package runs the aarch64 wheel's extension with it (import, --version, a produce/consume round trip).
aarch64-python:
	@dev/wheels/aarch64_python.sh .cache/aarch64-python

# The wheel tools, pinned; not setuptools-rust (the Python part is built without it, dev/build_wheels.py).
$(WHEEL_TOOLS)/.installed: Makefile
	@mkdir -p $(LASTAGENT_CACHE)
	@test -x $(WHEEL_TOOLS)/bin/python || $(PY) -m venv $(WHEEL_TOOLS)
	@$(WHEEL_TOOLS)/bin/pip install -q "ziglang==0.17.1" "cargo-zigbuild==0.24.1" "auditwheel==6.8.2" \
	  "setuptools==84.2.1" "wheel==0.48.0"
	@touch $@

.cache/kafka/jars/.complete:
	@$(PY) dev/kafka_broker.py resolve

# One Maven at a time (order-only prerequisites): make test runs set-up two jobs at a time, and two Mavens
# downloading into one local repository can leave a file half-written.
.cache/spark/jars/.complete: $(VENV)/.deps dev/spark/pom.xml | .cache/s3/jars/.complete
	@$(PYTHON) dev/spark_jars.py

# hadoop-aws and the AWS SDK v2 modules it uses (not the 686 MB SDK bundle), for s3a:// in Spark.
.cache/spark/s3a-jars/.complete: $(VENV)/.deps dev/spark/s3a-pom.xml | .cache/spark/jars/.complete
	@$(PYTHON) dev/spark_jars.py --s3a

# A class-data archive of Spark's driver JVM for the tests' many short-lived drivers (dev/spark_cds.py; about 30 s,
# once per pyspark version): tests/conftest.py starts them with it, at about a third of their CPU. Users' runs are untouched.
.cache/spark/cds/.complete: $(VENV)/.installed .cache/spark/jars/.complete .cache/spark/s3a-jars/.complete dev/spark_cds.py
	@echo "setup: dumping a class-data archive of Spark's driver JVM for the tests (dev/spark_cds.py)"
	@$(PYTHON) dev/spark_cds.py >>$(LOG) 2>&1 || (tail -30 $(LOG); exit 1)
	@touch $@

.cache/s3/jars/.complete: dev/s3/pom.xml | .cache/kafka/jars/.complete
	@$(PY) dev/s3_server.py resolve

kafka-up: .cache/kafka/jars/.complete
	@$(PY) dev/kafka_broker.py up

kafka-down:
	@$(PY) dev/kafka_broker.py down

# A secured broker (SASL_SSL, SCRAM-SHA-512, ACLs) on LASTAGENT_SECURED_KAFKA_PORT (default 39192)
# and the two ports above it; state and PKI in .cache/kafka/secured-<port>.
kafka-up-secured: .cache/kafka/jars/.complete
	@$(PY) dev/kafka_broker.py up --secured

kafka-down-secured:
	@$(PY) dev/kafka_broker.py down --secured

# A replicated cluster: 3 KRaft nodes (broker + controller) on LASTAGENT_KAFKA_CLUSTER_PORT (default 39300)
# and the five ports above it; replication factor 3 everywhere, min.insync.replicas=2; .cache/kafka/cluster-<port>.
kafka-up-cluster: .cache/kafka/jars/.complete
	@$(PY) dev/kafka_broker.py up --cluster

kafka-down-cluster:
	@$(PY) dev/kafka_broker.py down --cluster

# An S3-compatible server (s3proxy, filesystem backend) on LASTAGENT_S3_PORT (default 39900), path-style,
# bound to 127.0.0.1; keys in dev/s3_server.py (ACCESS_KEY, SECRET_KEY); objects in .cache/s3/<port>/data.
S3_BUCKETS ?= lastagent
s3-up: .cache/s3/jars/.complete
	@$(PY) dev/s3_server.py up $(addprefix --bucket ,$(S3_BUCKETS))

s3-down:
	@$(PY) dev/s3_server.py down

run: setup kafka-up
	@$(PYTHON) dev/demo.py

# Every tier but the two cluster tiers, the Spark-version matrix, the soak and the sdist's compile from source
# (make test-cluster, make test-kafka-cluster, make test-spark-versions, make test-soak, make test-wheel; .ci/run runs
# the first three after it, the Spark-version matrix on all four minors). Two pytest workers (pytest-xdist), one test
# file at a time each, the longest files first (tests/conftest.py): most of a crash test is waiting on a JVM, a
# broker or a timeout, so two fit on two cores. Each worker has its own broker and Spark session. Where the time
# goes: python dev/test_times.py .cache/test-times.xml (docs/testing.md). Set-up and lint run two jobs at a time:
# the jars download while the wheel compiles, and lint runs beside the JVM archive's dump.
TEST_WORKERS ?= 2
test:
	@$(MAKE) --no-print-directory -j2 setup $(TEST_JVM) lint
	$(PYTEST) tests -m "not soak and not cluster and not kafka_cluster and not source_build and not spark_versions and not kafka_versions" \
	  -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=40 --junitxml=.cache/test-times.xml

# Zero findings: ruff on the tree, mypy on the package as installed (py.typed), clippy on native/ (every
# unsafe block documented: clippy::undocumented_unsafe_blocks). Clippy runs as setup's build does (dev/build_wheels.py
# --clippy: same target, features and compilers), so OpenSSL and librdkafka are not built again.
lint: setup
	$(PYTHON) -m ruff check connector sources sinks tests bench dev
	$(PYTHON) -m mypy -p lastagent
	$(WHEEL_TOOLS)/bin/python dev/build_wheels.py --clippy --arch $(HOST_ARCH)

test-unit: setup
	$(PYTEST) tests/unit -m unit

# The first thing to run after a change: ruff, mypy and the unit tests (no broker, no Spark session); clippy only in
# make lint and make test, since it compiles native/.
check: setup
	$(PYTHON) -m ruff check connector sources sinks tests bench dev
	$(PYTHON) -m mypy -p lastagent
	$(PYTEST) tests/unit -m unit -q

test-integration: setup $(TEST_JVM)
	$(PYTEST) tests/integration

test-chaos: setup $(TEST_JVM)
	$(PYTEST) tests/chaos

# Every crash point with Spark's Python daemon on and off (make test spreads them over the two).
test-chaos-full: setup $(TEST_JVM)
	LASTAGENT_CHAOS_FULL=1 $(PYTEST) tests/chaos

# The package as users install it: this machine's portable wheel (make setup builds it) in fresh virtualenvs with no
# toolchain, both links' queries run from it (part of make test too); the sdist compiled from source (about 3
# minutes, only here); the aarch64 wheel under qemu-user once make wheels and make aarch64-python made it.
test-wheel: setup $(TEST_JVM)
	$(PYTEST) tests/package

# Every Spark 4 minor (4.0, 4.1, 4.2, 4.3; the newest patch of each): the portable wheel and that pyspark in a fresh
# virtualenv outside the repository, no compiler on PATH; both links with a driver SIGKILLed and restarted, admission
# control; read back by deltalake and a read_committed consumer (tests/spark_versions; about 8 minutes).
# SPARK_VERSIONS="4.0.5 4.1.4" runs those minors only.
SPARK_VERSIONS ?=
test-spark-versions: setup $(TEST_JVM)
	LASTAGENT_SPARK_VERSIONS="$(SPARK_VERSIONS)" $(PYTEST) tests/spark_versions --durations=10

# Every Kafka broker release users run (3.9.1 with transaction protocol 1; 4.0.1, 4.2.1, 4.3.1 and the newest, 4.4.0,
# with protocol 2): each a single KRaft broker of that release (dev/kafka_broker.py --kafka-version, jars from Maven
# Central), every link and the epoch block in one driver SIGKILLed and restarted, and a transactional id run past the
# producer-epoch limit (tests/kafka_versions; about 3 minutes a version). KAFKA_VERSIONS="3.9.1 4.4.0" runs those
# only; KAFKA_VERSIONS_TESTS=every_link the links and the block only (.ci/run, on the oldest and the newest).
KAFKA_VERSIONS ?=
KAFKA_VERSIONS_TESTS ?=
test-kafka-versions: setup $(TEST_JVM)
	LASTAGENT_KAFKA_VERSIONS="$(KAFKA_VERSIONS)" $(PYTEST) tests/kafka_versions --durations=10 \
	  $(if $(KAFKA_VERSIONS_TESTS),-k "$(KAFKA_VERSIONS_TESTS)")

# A Spark standalone cluster (master + two workers on 127.0.0.1): the three links, a driver and a worker killed.
test-cluster: setup $(TEST_JVM)
	$(PYTEST) tests/cluster

# A replicated 3-node Kafka cluster losing brokers (rolling restart, coordinator SIGKILLed) under the three
# running links: no query fails, every record once (tests/kafka_cluster; about 10 minutes on a 2-core machine).
test-kafka-cluster: setup $(TEST_JVM)
	$(PYTEST) tests/kafka_cluster

# A Spark Connect server and Connect clients (subprocesses): source, both sinks, recovery after a server kill.
test-connect: setup $(TEST_JVM)
	$(PYTEST) tests/connect

# The notebooks (Databricks source format), top to bottom, headless, against the local broker.
test-notebook: setup $(TEST_JVM)
	$(PYTEST) tests/notebook

# The kill soak: the three links while drivers and executor Python workers are SIGKILLed at seeded random
# times, then verified (docs/reliability.md). make test-soak runs a short one (tests/soak).
test-soak: setup $(TEST_JVM)
	$(PYTEST) tests/soak

KILLS ?= 300
SEED  ?= 7301
SOAK_ARGS ?=
soak: setup kafka-up
	$(PYTHON) dev/soak.py --kills $(KILLS) --seed $(SEED) --report .cache/soak-$(SEED).json --workdir .cache/soak $(SOAK_ARGS)

# A link's age (issue "a year of epochs"): a Kafka -> Kafka link for BENCH_EPOCHS epochs (default 20,000), the first
# and last 1,000 epochs' times, restarts, files on disk, beside Spark's own kafka -> kafka over 2,000 epochs first
# (docs/benchmarks.md). BENCH_LINK picks another link (5,000 epochs by default): kafka-delta, delta-kafka or block.
# Kept in .cache/long-run-<link>: BENCH_SECONDS=N stops it after N seconds, and the same command goes on.
bench-long-run: setup kafka-up
	cd bench && out=../.cache/bench-long-run-$${BENCH_LINK:-kafka-kafka}.json && \
		BENCH_WORKDIR=$${BENCH_WORKDIR:-../.cache/long-run-$${BENCH_LINK:-kafka-kafka}} ../$(PYTHON) long_run.py > $$out; \
		rc=$$?; cat $$out; exit $$rc

bench: setup kafka-up
	cd bench && ../$(PYTHON) source_bench.py | tee ../.cache/bench-source.json
	cd bench && ../$(PYTHON) source_phases.py | tee ../.cache/bench-source-phases.json
	cd bench && ../$(PYTHON) sink_bench.py | tee ../.cache/bench-sink.json
	cd bench && ../$(PYTHON) sink_phases.py | tee ../.cache/bench-sink-phases.json
	cd bench && ../$(PYTHON) task_phases.py | tee ../.cache/bench-task-phases.json
	cd bench && ../$(PYTHON) commit_check.py | tee ../.cache/bench-commit-check.json
	cd bench && ../$(PYTHON) epoch_cost.py | tee ../.cache/bench-epoch-cost.json
	cd bench && ../$(PYTHON) scale_bench.py | tee ../.cache/bench-scale.json
	cd bench && ../$(PYTHON) merge_bench.py | tee ../.cache/bench-merge.json
	cd bench && ../$(PYTHON) ceiling_bench.py | tee ../.cache/bench-ceiling.json
	cd bench && ../$(PYTHON) delta_bench.py | tee ../.cache/bench-delta.json
	cd bench && ../$(PYTHON) delta_commit_bench.py | tee ../.cache/bench-delta-commit.json
	cd bench && ../$(PYTHON) row_rules.py | tee ../.cache/bench-row-rules.json
	cd bench && ../$(PYTHON) objectstore_bench.py | tee ../.cache/bench-objectstore.json
	cd bench && ../$(PYTHON) groups_bench.py | tee ../.cache/bench-groups.json
	cd bench && ../$(PYTHON) groups_bench.py --curve | tee ../.cache/bench-groups-curve.json
	cd bench && ../$(PYTHON) groups_overhead.py | tee ../.cache/bench-groups-overhead.json

docs: setup
	$(PYTHON) -m lastagent.options_doc > docs/options.md

# ~/.cache/lastagent (cargo's target dir, the wheel tools) is shared by every clone and stays; rm -rf it to build anew.
clean:
	rm -rf $(VENV) .cache build dist *.egg-info
