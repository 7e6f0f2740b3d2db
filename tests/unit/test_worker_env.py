"""lastagent.worker_env's pure part: which keys Spark's Python streaming source runner adds, and which are missing."""

import pytest

from lastagent.worker_env import missing, runner_keys

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("version,keys", [
    ("4.0.5", ("SPARK_LOCAL_DIRS", "SPARK_AUTH_SOCKET_TIMEOUT", "SPARK_BUFFER_SIZE")),
    ("4.1.4", ("SPARK_LOCAL_DIRS", "SPARK_AUTH_SOCKET_TIMEOUT", "SPARK_BUFFER_SIZE")),
    ("4.2.1", ("SPARK_LOCAL_DIRS", "SPARK_AUTH_SOCKET_TIMEOUT", "SPARK_BUFFER_SIZE", "SPARK_PYTHON_RUNTIME")),
    ("4.3.0", ("SPARK_LOCAL_DIRS", "SPARK_AUTH_SOCKET_TIMEOUT", "SPARK_BUFFER_SIZE", "SPARK_PYTHON_RUNTIME")),
])
def test_the_keys_each_spark_runner_puts(version, keys):
    # Read from each pyspark's PythonStreamingSourceRunner.init bytecode (javap): 4.2 added SPARK_PYTHON_RUNTIME.
    assert runner_keys(version) == keys


def test_a_key_already_there_keeps_its_value_and_only_absent_ones_are_added():
    wanted = {"SPARK_LOCAL_DIRS": "/tmp/blockmgr-1", "SPARK_BUFFER_SIZE": "65536"}
    assert missing({"PYTHONPATH", "SPARK_BUFFER_SIZE"}, wanted) == {"SPARK_LOCAL_DIRS": "/tmp/blockmgr-1"}
    assert missing(set(wanted), wanted) == {}
