"""The parameter server: push and pull by key, one server or sharded, bytes as counted."""

import pytest
import torch
import torch.distributed as dist

from d2lpar.comm import param_server as PS
from d2lpar.processes.launch import launch


def _kv_store():
    rank = dist.get_rank()
    values = {"w": torch.full((3, 2), float(rank)), "b": torch.full((5,), 10.0 * rank),
              "tiny": torch.tensor([1.0])}
    ps = PS.ParameterServer(servers=2)
    ps.push(values)
    pulled = {k: torch.zeros_like(v) for k, v in values.items()}
    ps.pull(pulled)
    return {k: v.tolist() for k, v in pulled.items()}, ps.placement(values)


def test_key_value_store_push_pull():
    results = launch(_kv_store, 3, timeout=30)
    for pulled, placement in results:
        assert pulled["w"] == [[3.0, 3.0]] * 3 and pulled["b"] == [30.0] * 5
        assert pulled["tiny"] == [3.0]
        assert placement == results[0][1] and set(placement.values()) == {0, 1}


def _bad_servers():
    PS.ParameterServer(servers=5)


def test_errors_and_formula():
    with pytest.raises(Exception, match="servers=5"):
        launch(_bad_servers, 2, timeout=30)
    assert PS.ps_server_formula(100, 4) == 600
    one = PS.ps_bytes(12, 4, servers=1)
    assert one[0] == {"sent": 3 * 48, "received": 3 * 48} and one[1] == {"sent": 48, "received": 48}
