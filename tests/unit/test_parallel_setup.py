"""Process-group environment parsing, layer-spec choice and the CPU settings of the Megatron config."""

from __future__ import annotations

import pytest

from megatron_ppo.config.schema import MegatronConfig, ModelConfig
from megatron_ppo.models import build_transformer_config, padded_vocab_size, select_layer_spec
from megatron_ppo.parallel import dist_env_from_environment, first_host


def test_torchrun_variables_win() -> None:
    env = dist_env_from_environment(
        {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "1234",
         "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    )  # fmt: skip
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (3, 8, 1, "n1", 1234)


def test_slurm_variables_give_rank_and_master() -> None:
    env = dist_env_from_environment(
        {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5", "SLURM_JOB_NODELIST": "gpu[007-008]"}
    )
    assert (env.rank, env.world_size, env.local_rank, env.master_addr) == (5, 16, 5, "gpu007")


def test_single_process_without_launcher() -> None:
    assert dist_env_from_environment({}).world_size == 1


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [("node01", "node01"), ("gpu[003-005,010]", "gpu003"), ("a[1,4],b[2-3]", "a1"), ("cpu1,cpu2", "cpu1")],
)
def test_first_host_of_a_slurm_node_list(nodelist: str, first: str) -> None:
    assert first_host(nodelist) == first


def test_transformer_engine_demanded_on_cpu_fails_with_the_fix() -> None:
    with pytest.raises(RuntimeError, match=r"model\.transformer_impl=local"):
        select_layer_spec(ModelConfig(transformer_impl="transformer_engine"))


def test_local_spec_is_chosen_without_cuda() -> None:
    _, uses_te = select_layer_spec(ModelConfig(transformer_impl="auto"))
    assert not uses_te


def test_padded_vocab_is_the_same_for_every_tensor_parallel_size() -> None:
    model = ModelConfig(vocab_size=151_665)
    assert {padded_vocab_size(model, tp) for tp in (1, 2, 4, 8)} == {151_680}
    assert padded_vocab_size(ModelConfig(vocab_size=45, make_vocab_size_divisible_by=1), 2) == 46


def test_cpu_config_initialises_on_cpu_and_sends_pipeline_messages_one_by_one() -> None:
    config = build_transformer_config(ModelConfig(params_dtype="fp32"), MegatronConfig(pipeline_model_parallel_size=2))
    assert config.use_cpu_initialization and not config.batch_p2p_comm and not config.variable_seq_lengths
    assert not (config.gradient_accumulation_fusion or config.masked_softmax_fusion or config.bias_dropout_fusion)


def test_a_single_process_takes_its_port_from_master_port_or_else_from_the_os() -> None:
    assert dist_env_from_environment({}).master_port == 0, "a port the OS picks as the rendezvous binds it"
    assert dist_env_from_environment({"MASTER_PORT": "29511"}).master_port == 29511


def test_a_single_process_starts_while_the_default_port_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two single-process runs on one machine (or one beside a torchrun job on 29500) each start: the rendezvous
    binds a port the OS picks. Before, the second was refused with 'port 29500 … is already in use'."""
    import socket

    import torch.distributed as dist

    from megatron_ppo.parallel import destroy_distributed, init_distributed
    from megatron_ppo.parallel.launch_env import DEFAULT_PORT

    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as default:
        try:  # held by this test, or by another process already: taken either way
            default.bind(("127.0.0.1", DEFAULT_PORT))
            default.listen()
        except OSError:
            pass
        env = init_distributed(MegatronConfig(), seed=0, device="cpu")
        try:
            assert env.world_size == 1 and dist.is_initialized() and dist.get_world_size() == 1
        finally:
            destroy_distributed()
