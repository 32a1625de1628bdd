"""Several ranks on one GPU (``LONGCTX_SHARE_GPU=1``, :mod:`megatron.plugin.shared_gpu`): the
environment each rank gets, the planners' budget per rank, the refusal of the refits, and
nothing at all with the switch off."""
import argparse
import types

import pytest

from megatron.plugin import arguments, shared_gpu
from longctx import job_costs
from sppo_offload import flags as sppo_flags

GIB = 80 * 1e9


def launched(local_rank: int, world: int, switch: str | None = "1") -> dict:
    env = {"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(world)}
    if switch is not None:
        env[shared_gpu.SWITCH] = switch
    return env


def test_each_rank_gets_the_device_modulo_the_count_and_a_host_id_of_its_own():
    envs = [launched(rank, 4) for rank in range(4)]
    for env in envs:
        shared_gpu.apply(env, device_count=1)
    assert [env["LOCAL_RANK"] for env in envs] == ["0", "0", "0", "0"]
    assert len({env["NCCL_HOSTID"] for env in envs}) == 4
    for env in envs:
        for name, value in shared_gpu.SOCKET_SETTINGS.items():
            assert env[name] == value
    assert shared_gpu.SOCKET_SETTINGS == {
        "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket",
        "NCCL_MNNVL_ENABLE": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def test_two_devices_take_alternate_ranks():
    envs = [launched(rank, 4) for rank in range(4)]
    for env in envs:
        shared_gpu.apply(env, device_count=2)
    assert [env["LOCAL_RANK"] for env in envs] == ["0", "1", "0", "1"]
    assert [shared_gpu.ranks_per_device(rank, 3, 2) for rank in range(3)] == [2, 1, 2]


def test_a_second_start_up_in_the_same_process_keeps_the_launched_rank():
    env = launched(3, 4)
    shared_gpu.apply(env, device_count=2)
    first = dict(env)
    shared_gpu.apply(env, device_count=2)
    assert env == first
    assert env["NCCL_HOSTID"].endswith("-rank3") and env["LOCAL_RANK"] == "1"


def test_switch_off_changes_nothing():
    for switch in (None, "0"):
        env = launched(3, 4, switch)
        before = dict(env)
        shared_gpu.apply(env, device_count=1)
        assert env == before
        assert shared_gpu.budget_divisor(env, device_count=1) == 1


def test_bad_switch_value_and_no_gpu_are_refused():
    with pytest.raises(ValueError, match="LONGCTX_SHARE_GPU='yes'"):
        shared_gpu.apply(launched(0, 2, "yes"), device_count=1)
    with pytest.raises(ValueError, match="this machine has none"):
        shared_gpu.apply(launched(0, 2), device_count=0)


def fake_cuda(monkeypatch, env: dict, devices: int = 1):
    monkeypatch.delenv(shared_gpu.SWITCH, raising=False)
    monkeypatch.delenv(shared_gpu.LAUNCHED_LOCAL_RANK, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(job_costs.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(job_costs.torch.cuda, "device_count", lambda: devices)
    monkeypatch.setattr(job_costs.torch.cuda, "get_device_properties",
                        lambda *a: types.SimpleNamespace(total_memory=GIB))


@pytest.mark.parametrize("world,devices,share", [(4, 1, 4), (2, 1, 2), (4, 2, 2), (1, 1, 1)])
def test_default_budget_is_the_device_divided_by_the_ranks_sharing_it(monkeypatch, world,
                                                                       devices, share):
    fake_cuda(monkeypatch, launched(0, world), devices)
    assert job_costs.device_memory_gb() == pytest.approx(80 / share)
    assert sppo_flags.memory_budget_gb(argparse.Namespace(sppo_memory_gb=None)) \
        == pytest.approx(80 / share)


def test_given_budget_is_one_ranks_as_given(monkeypatch):
    fake_cuda(monkeypatch, launched(0, 4))
    assert sppo_flags.memory_budget_gb(argparse.Namespace(sppo_memory_gb=7.5)) == 7.5


def test_switch_off_keeps_the_whole_device(monkeypatch):
    fake_cuda(monkeypatch, launched(0, 4, None))
    assert job_costs.device_memory_gb() == pytest.approx(80)


def test_refits_are_refused_while_sharing(monkeypatch):
    args = argparse.Namespace(elastic_refit_interval=3)
    monkeypatch.setenv(shared_gpu.SWITCH, "1")
    message = shared_gpu.refit_refusal(args)
    assert "--elastic-refit-interval 3" in message and "drop" in message
    assert shared_gpu.refit_refusal in arguments.RULES
    assert shared_gpu.refit_refusal(argparse.Namespace(elastic_refit_interval=0)) is None
    monkeypatch.setenv(shared_gpu.SWITCH, "0")
    assert shared_gpu.refit_refusal(args) is None


def test_the_default_refit_times_nothing_while_sharing(monkeypatch):
    """``--elastic-refit-interval auto`` (the default) is no refusal: it is off while ranks
    share a GPU, on otherwise."""
    import torch

    from elastic_pipe.run_costs import AUTO, refit_interval

    args = argparse.Namespace(elastic_refit_interval=AUTO)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv(shared_gpu.SWITCH, "1")
    assert shared_gpu.refit_refusal(args) is None
    assert refit_interval(args) == 0
    monkeypatch.setenv(shared_gpu.SWITCH, "0")
    assert refit_interval(args) == AUTO
