"""Fixtures shared by the reliability tests: one set of engine processes for the package.

``cluster`` is a ``TestCluster`` that lives for the whole package; modules add the engines and
routers they need to it (started once, idle between tests). ``shared`` is its baseline: a
prefill and a decode engine (tcp transport, 2 s leases, 2 s transfer timeout) and a router
in front of them. Tests that kill or restart engines build their own cluster instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pdserve.client import Client
from tests.helpers.reliability import Proc, TestCluster


@dataclass
class Shared:
    prefill: Proc
    decode: Proc
    router: Proc
    client: Client


@pytest.fixture(scope="package")
def cluster(request, tiny_model_dir):
    with TestCluster(tiny_model_dir) as test_cluster:
        yield test_cluster
        if request.session.testsfailed:
            test_cluster.failed = True  # keep the processes' logs
            print(f"\nreliability cluster logs kept in {test_cluster.log_dir}")


@pytest.fixture(scope="package")
def shared(cluster):
    prefill = cluster.engine("prefill", "prefill")
    decode = cluster.engine("decode", "decode")
    cluster.wait_serving()
    router = cluster.router("router", [prefill], [decode])
    router.wait_serving()
    with Client(router.address) as client:
        yield Shared(prefill, decode, router, client)


@pytest.fixture(scope="package")
def tokenizer(tiny_llm):
    return tiny_llm.tokenizer
