"""FPDTConfig: defaults, FPDT_* environment fallback, explicit values win, clear errors."""

from __future__ import annotations

import pytest

from hf_fpdt import FPDTConfig, FPDTRuntime


def test_defaults():
    cfg = FPDTConfig()
    assert cfg.chunk_size == 65536
    assert cfg.offload == "auto"
    assert cfg.sp_size == 1
    assert cfg.mlp_chunks is None and cfg.loss_chunks is None
    assert cfg.offload_layer_inputs is True
    assert cfg.to_dict()["chunk_size"] == 65536


def test_env_fallback(monkeypatch):
    monkeypatch.setenv("FPDT_CHUNK_SIZE", " 4096 ")
    monkeypatch.setenv("FPDT_OFFLOAD", "off")
    monkeypatch.setenv("FPDT_SP_SIZE", "4")
    monkeypatch.setenv("FPDT_MLP_CHUNKS", "3")
    monkeypatch.setenv("FPDT_LOSS_CHUNKS", "5")
    monkeypatch.setenv("FPDT_OFFLOAD_LAYER_INPUTS", "0")
    cfg = FPDTConfig()
    assert (cfg.chunk_size, cfg.offload, cfg.sp_size) == (4096, False, 4)
    assert (cfg.mlp_chunks, cfg.loss_chunks, cfg.offload_layer_inputs) == (3, 5, False)


@pytest.mark.parametrize(
    "raw,expected",
    [("1", True), ("TRUE", True), ("yes", True), ("on", True), ("0", False), ("False", False), ("no", False)]
    + [("auto", "auto"), (" Auto ", "auto")],
)
def test_env_offload_spellings(monkeypatch, raw, expected):
    monkeypatch.setenv("FPDT_OFFLOAD", raw)
    assert FPDTConfig().offload == expected


def test_env_chunk_size_auto(monkeypatch):
    monkeypatch.setenv("FPDT_CHUNK_SIZE", "AUTO")
    assert FPDTConfig().chunk_size == "auto"


def test_explicit_values_override_env(monkeypatch):
    monkeypatch.setenv("FPDT_CHUNK_SIZE", "4096")
    monkeypatch.setenv("FPDT_OFFLOAD", "0")
    cfg = FPDTConfig(chunk_size=128, offload=True)
    assert cfg.chunk_size == 128 and cfg.offload is True


def test_runtime_reads_env_through_config(monkeypatch):
    monkeypatch.setenv("FPDT_CHUNK_SIZE", "96")
    monkeypatch.setenv("FPDT_OFFLOAD", "false")
    rt = FPDTRuntime()
    assert rt.global_chunk_size(None) == 96
    assert rt.store("cpu").enabled is False


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": -5}, "chunk_size"),
        ({"chunk_size": 1.5}, "chunk_size"),
        ({"chunk_size": True}, "chunk_size"),
        ({"chunk_size": "big"}, "chunk_size"),
        ({"offload": "maybe"}, "offload"),
        ({"offload": "true"}, "offload"),
        ({"sp_size": 0}, "sp_size"),
        ({"sp_size": 2.0}, "sp_size"),
        ({"mlp_chunks": 0}, "mlp_chunks"),
        ({"loss_chunks": -1}, "loss_chunks"),
        ({"loss_chunks": False}, "loss_chunks"),
        ({"chunk_size": 2, "sp_size": 4}, "smaller than sp_size"),
        ({"cpu_threads": 0}, r"cpu_threads=0 .*positive number of threads"),
        ({"cpu_threads": True}, "cpu_threads"),
        ({"cpu_threads": 2.0}, "cpu_threads"),
        ({"cpu_threads": "4"}, "cpu_threads"),
        ({"cpu_threads": "max"}, r"cpu_threads='max'.*'auto'"),
        ({"sync_exchanges": "yes"}, r"sync_exchanges='yes' .*True .*False"),
        ({"sync_exchanges": 1}, "sync_exchanges"),
    ],
)
def test_bad_values_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FPDTConfig(**kwargs)


@pytest.mark.parametrize(
    "name,raw",
    [
        ("FPDT_CHUNK_SIZE", "lots"),
        ("FPDT_CHUNK_SIZE", "0"),
        ("FPDT_CHUNK_SIZE", "64k"),
        ("FPDT_OFFLOAD", "maybe"),
        ("FPDT_OFFLOAD", "2"),
        ("FPDT_SP_SIZE", "auto"),
        ("FPDT_SP_SIZE", "-2"),
        ("FPDT_MLP_CHUNKS", "x"),
        ("FPDT_LOSS_CHUNKS", "0"),
        ("FPDT_OFFLOAD_LAYER_INPUTS", "perhaps"),
        ("FPDT_CPU_THREADS", "0"),
        ("FPDT_CPU_THREADS", "two"),
        ("FPDT_SYNC_EXCHANGES", "auto"),
        ("FPDT_SYNC_EXCHANGES", "sometimes"),
    ],
)
def test_bad_env_values_raise(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=name.removeprefix("FPDT_").lower() + "|" + name):
        FPDTConfig()


def test_cpu_threads_default_env_and_explicit(monkeypatch):
    assert FPDTConfig().cpu_threads == "auto"
    monkeypatch.setenv("FPDT_CPU_THREADS", " 3 ")
    assert FPDTConfig().cpu_threads == 3
    monkeypatch.setenv("FPDT_CPU_THREADS", "AUTO")
    assert FPDTConfig().cpu_threads == "auto"
    assert FPDTConfig(cpu_threads=1).cpu_threads == 1  # explicit wins over the environment
    monkeypatch.setenv("FPDT_CPU_THREADS", "0")
    with pytest.raises(ValueError, match=r"FPDT_CPU_THREADS='0' \(environment variable\): cpu_threads=0"):
        FPDTConfig()


def test_sync_exchanges_default_env_and_explicit(monkeypatch):
    assert FPDTConfig().sync_exchanges is False  # overlapped by default
    monkeypatch.setenv("FPDT_SYNC_EXCHANGES", "1")
    assert FPDTConfig().sync_exchanges is True
    assert FPDTConfig(sync_exchanges=False).sync_exchanges is False  # explicit wins over the environment


def test_sp_size_without_group_raises():
    with pytest.raises(ValueError, match="process group"):
        FPDTRuntime(FPDTConfig(chunk_size=64, sp_size=2))


@pytest.mark.parametrize("value", [1, 0, "yes"])
def test_offload_must_be_bool_or_auto(value):
    with pytest.raises(ValueError, match="offload"):
        FPDTConfig(offload=value)


def test_offload_layer_inputs_env_rejects_auto(monkeypatch):
    monkeypatch.setenv("FPDT_OFFLOAD_LAYER_INPUTS", "auto")
    with pytest.raises(ValueError, match="FPDT_OFFLOAD_LAYER_INPUTS"):
        FPDTConfig()


@pytest.mark.multiprocess
def test_runtime_takes_the_group_size_without_changing_the_callers_config():
    from distributed import run_distributed

    assert run_distributed(_group_size_adopted, 2) == [(1, 2, "ValueError"), (1, 2, "ValueError")]


def _group_size_adopted(rank: int, world_size: int) -> tuple:
    import torch.distributed as dist

    config = FPDTConfig(chunk_size=64)
    runtime = FPDTRuntime(config, dist.group.WORLD)
    try:
        FPDTRuntime(FPDTConfig(chunk_size=64, sp_size=4), dist.group.WORLD)  # explicit, conflicting
        conflict = None
    except ValueError as exc:
        conflict = type(exc).__name__
    return config.sp_size, runtime.config.sp_size, conflict


def test_every_fpdt_variable_the_package_names_is_listed_with_its_field():
    """``ENV_NAMES`` is the one list of environment variables: one per FPDTConfig field (the pattern has none),
    every ``FPDT_*`` the package reads or names in a message is in it, the module docstring's table shows each
    beside its field, and each is read (a bad value is refused naming the field or the variable)."""
    import dataclasses
    import re
    from pathlib import Path

    import hf_fpdt
    from hf_fpdt import config

    fields = {f.name for f in dataclasses.fields(FPDTConfig)} - {"attention_pattern"}
    assert set(config.ENV_NAMES) == fields
    package = Path(hf_fpdt.__file__).parent
    named = {m for path in package.rglob("*.py") for m in re.findall(r"\bFPDT_[A-Z][A-Z_]*", path.read_text())}
    assert named and named <= set(config.ENV_NAMES.values()), named - set(config.ENV_NAMES.values())
    for field, name in config.ENV_NAMES.items():
        assert re.search(rf"^``{field}``\s+``{name}``", config.__doc__, re.M), name
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(name, "?bad?")
            with pytest.raises(ValueError, match=f"{field}|{name}"):
                FPDTConfig()
