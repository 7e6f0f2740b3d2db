"""The development broker's pure helpers (``dev/kafka_broker.py``)."""

from __future__ import annotations

import base64

import kafka_broker  # dev/, on the path from tests/conftest.py
import pytest

pytestmark = pytest.mark.unit


def test_cluster_ids_never_start_with_a_dash() -> None:
    # A dash-led id made the storage tool read it as an option: 1 format in 64 failed (CI, stop 19).
    # 5,000 draws miss a dash-led id with probability (63/64)^5000, about 1e-34.
    ids = [kafka_broker.new_cluster_id() for _ in range(5000)]
    assert not [i for i in ids if i.startswith("-")]
    assert len(set(ids)) == len(ids)
    assert all(len(base64.urlsafe_b64decode(i + "==")) == 16 for i in ids)
