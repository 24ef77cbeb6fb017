"""``kvbridge serve``'s plan without starting vLLM: command lines, environments, secrets, KV cache sizes."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from connector.vllm_settings import ConnectorSettings
from connector.vllm_store import StoreSettings
from kv_pipe.errors import KVConfigError
from launch import kv_memory, redis_server, serve

GIB, MIB = 1 << 30, 1 << 20
SECRET = "s3cret-Tr0ub4dor&3"
SERVE_ARGS = ["--dtype", "float32", "--max-model-len", "512"]


def args(*extra: str) -> object:
    return serve.parser().parse_args(
        ["/models/tiny", "--prefill-port", "8101", "--decode-port", "8201", "--kv-port", "15000", *extra]
    )


def option(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


# ---------------------------------------------------------------------------------------------- memory


def test_kv_cache_size_is_half_the_available_memory_split_and_capped() -> None:
    assert kv_memory.kv_cache_bytes(8 * GIB, 2) == 2 * GIB
    assert kv_memory.kv_cache_bytes(7 * GIB + 12345, 2) == 7 * GIB // 4 // MIB * MIB  # whole MiB
    assert kv_memory.kv_cache_bytes(1 << 40, 2) == kv_memory.KV_CAP_BYTES


def write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_available_memory_is_the_tightest_of_host_numa_nodes_and_cgroup(tmp_path: Path) -> None:
    assert kv_memory.available_memory(str(tmp_path)) is None  # a host that says nothing
    write(tmp_path, "proc/meminfo", "MemTotal:       24000000 kB\nMemAvailable:   20971520 kB\n")  # 20 GiB
    assert kv_memory.available_memory(str(tmp_path)) == 20 * GIB
    node = (
        "Node {n} MemFree: {free} kB\nNode {n} Active(file): 1048576 kB\nNode {n} Inactive(file): 524288 kB\n"
        "Node {n} SReclaimable: 524288 kB\nNode {n} Active(anon): 999999999 kB\n"
    )
    write(tmp_path, "sys/devices/system/node/node0/meminfo", node.format(n=0, free=6 * 1048576))  # 8 GiB
    write(tmp_path, "sys/devices/system/node/node1/meminfo", node.format(n=1, free=10 * 1048576))  # 12 GiB
    assert kv_memory.available_memory(str(tmp_path)) == 8 * GIB
    write(tmp_path, "sys/fs/cgroup/memory.max", "max\n")  # cgroup v2 without a limit
    write(tmp_path, "sys/fs/cgroup/memory.current", str(GIB))
    assert kv_memory.available_memory(str(tmp_path)) == 8 * GIB
    write(tmp_path, "sys/fs/cgroup/memory.max", str(6 * GIB))
    assert kv_memory.available_memory(str(tmp_path)) == 5 * GIB


def test_cgroup_v1_limit_counts_unless_it_is_the_no_limit_value(tmp_path: Path) -> None:
    write(tmp_path, "proc/meminfo", "MemAvailable:   20971520 kB\n")
    write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")
    write(tmp_path, "sys/fs/cgroup/memory/memory.usage_in_bytes", str(GIB))
    assert kv_memory.available_memory(str(tmp_path)) == 20 * GIB
    write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", str(4 * GIB))
    assert kv_memory.available_memory(str(tmp_path)) == 3 * GIB


def test_each_cpu_instance_gets_a_kv_cache_size_and_the_choice_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="launch.serve"):
        prefill, decode = serve.plan(args(), SERVE_ARGS, {}, kv_budget=8 * GIB)
    assert (prefill.name, prefill.port, decode.name, decode.port) == ("prefill", 8101, "decode", 8201)
    for instance, role in ((prefill, "kv_producer"), (decode, "kv_consumer")):
        command = instance.command
        assert command[command.index("--model") + 1] == "/models/tiny"
        assert option(command, "--port") == str(instance.port)
        assert command[-len(SERVE_ARGS) - 2 :] == [*SERVE_ARGS, "--kv-cache-memory-bytes", str(2 * GIB)]
        transfer = json.loads(option(command, "--kv-transfer-config"))
        assert (transfer["kv_role"], transfer["kv_port"], transfer["kv_connector"]) == (
            role,
            15000,
            "KVBridgeConnector",
        )
    assert json.loads(option(decode.command, "--kv-transfer-config"))["kv_load_failure_policy"] == "recompute"
    logged = [r.getMessage() for r in caplog.records if "--kv-cache-memory-bytes" in r.getMessage()]
    assert len(logged) == 2 and "2048 MiB" in logged[0] and "8192 MiB available" in logged[0]


@pytest.mark.parametrize(
    ("serve_args", "env_option", "sized"),
    [
        (["--kv-cache-memory-bytes", "123456789"], [], {"prefill", "decode"}),
        (["--kv-cache-memory-bytes=123456789"], [], {"prefill", "decode"}),
        (["--gpu-memory-utilization", "0.3"], [], {"prefill", "decode"}),
        ([], ["--decode-env", "VLLM_CPU_KVCACHE_SPACE=2"], {"decode"}),
    ],
)
def test_the_users_kv_cache_size_stands(serve_args: list[str], env_option: list[str], sized: set[str]) -> None:
    for instance in serve.plan(args(*env_option), serve_args, {}, kv_budget=8 * GIB):
        chosen = instance.command.count("--kv-cache-memory-bytes") - serve_args.count("--kv-cache-memory-bytes")
        assert chosen == (0 if instance.name in sized else 1), instance.name


def test_no_kv_cache_size_without_a_budget() -> None:
    for instance in serve.plan(args(), SERVE_ARGS, {}, kv_budget=None):  # an accelerator host
        assert "--kv-cache-memory-bytes" not in instance.command


# ---------------------------------------------------------------------------------------------- many instances


def transfer_of(instance: serve.Instance) -> dict:
    return json.loads(option(instance.command, "--kv-transfer-config"))


@pytest.mark.parametrize(("tp_args", "tp"), [([], 1), (["-tp", "2"], 2), (["--tensor-parallel-size=2"], 2)])
def test_two_prefill_and_two_decode_instances_get_ports_of_their_own(tp_args: list[str], tp: int) -> None:
    instances = serve.plan(
        args("--prefill-instances", "2", "--decode-instances", "2"), [*SERVE_ARGS, *tp_args], {}, kv_budget=8 * GIB
    )
    assert [i.name for i in instances] == ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    assert [i.port for i in instances] == [8101, 8102, 8201, 8202]
    transfers = [transfer_of(i) for i in instances]
    assert [t["kv_role"] for t in transfers] == ["kv_producer"] * 2 + ["kv_consumer"] * 2
    # Each prefill listens on its own ports (one per TP rank); decode instances fall back to prefill 0.
    assert [t["kv_port"] for t in transfers] == [15000, 15000 + tp, 15000, 15000]
    assert {t["kv_connector_extra_config"]["kv_ip"] for t in transfers} == {"127.0.0.1"}
    # 8 GiB / 2 / 4 instances of tp ranks each (vLLM's size is per TP rank)
    assert all(option(i.command, "--kv-cache-memory-bytes") == str(1 * GIB // tp) for i in instances)


def test_instances_are_spread_over_the_cores_or_share_them_when_there_are_too_few() -> None:
    many = serve.plan(
        args("--prefill-instances", "2", "--decode-instances", "2"),
        SERVE_ARGS,
        {},
        None,
        cores=[0, 1, 2, 3, 4, 5, 6, 7, 8],
    )
    assert [i.env[serve.BIND_ENV] for i in many] == ["0,1", "2,3", "4,5", "6,7"]
    few = serve.plan(args("--prefill-instances", "2", "--decode-instances", "1"), SERVE_ARGS, {}, None, cores=[3, 5])
    assert [i.env[serve.BIND_ENV] for i in few] == ["3", "5", "3"]


@pytest.mark.parametrize(
    ("given", "environ", "tp_args"),
    [
        (["--decode-env", "VLLM_CPU_OMP_THREADS_BIND=7"], {}, []),
        ([], {"VLLM_CPU_OMP_THREADS_BIND": "0-3"}, []),
    ],
)
def test_a_users_binding_stands(given: list[str], environ: dict, tp_args: list[str]) -> None:
    # Tensor-parallel instances get a bind per rank: tests/engines/test_tensor_parallel.py.
    instances = serve.plan(args(*given), [*SERVE_ARGS, *tp_args], environ, None, cores=[0, 1, 2, 3])
    prefill, decode = instances
    if given:
        assert (prefill.env[serve.BIND_ENV], decode.env[serve.BIND_ENV]) == ("0,1", "7")
    else:
        assert prefill.env.get(serve.BIND_ENV) == decode.env.get(serve.BIND_ENV) == environ.get(serve.BIND_ENV)


@pytest.mark.parametrize("bad", [["--prefill-instances", "0"], ["--decode-instances", "x"]])
def test_instance_counts_are_positive_numbers(bad: list[str]) -> None:
    with pytest.raises(SystemExit):
        args(*bad)


def test_a_bad_tensor_parallel_size_is_refused() -> None:
    with pytest.raises(KVConfigError, match="tensor-parallel-size"):
        serve.plan(args(), [*SERVE_ARGS, "-tp", "two"], {}, None)


# ---------------------------------------------------------------------------------------------- secrets


def test_the_secret_reaches_the_instances_through_their_environment(tmp_path: Path) -> None:
    path = tmp_path / "kv_secret"
    path.write_text(SECRET)
    path.chmod(0o600)
    plans = {
        "env": serve.plan(args(), SERVE_ARGS, {"KVBRIDGE_KV_SECRET": SECRET, "HOME": "/h"}, None),
        "file env": serve.plan(args(), SERVE_ARGS, {"KVBRIDGE_KV_SECRET_FILE": str(path), "HOME": "/h"}, None),
        "file key": serve.plan(
            args("--kv-extra", json.dumps({"kv_secret_file": str(path), "kv_timeout": 7})),
            SERVE_ARGS,
            {"HOME": "/h"},
            None,
        ),
    }
    for how, instances in plans.items():
        for instance in instances:
            assert instance.env == {"HOME": "/h", "KVBRIDGE_KV_SECRET": SECRET}, how
            assert not any(SECRET in arg or str(path) in arg for arg in instance.command), how
    extra = json.loads(option(plans["file key"][0].command, "--kv-transfer-config"))["kv_connector_extra_config"]
    assert extra == {"kv_ip": "127.0.0.1", "kv_timeout": 7}


@pytest.mark.parametrize(
    "given",
    [
        ["--kv-extra", json.dumps({"kv_secret": SECRET})],
        ["--prefill-env", f"KVBRIDGE_KV_SECRET={SECRET}"],
        ["--decode-env", "KVBRIDGE_KV_SECRET_FILE=/run/secret"],
    ],
)
def test_a_secret_on_the_command_line_is_refused(given: list[str]) -> None:
    with pytest.raises(KVConfigError, match="visible to every user") as error:
        serve.plan(args(*given), SERVE_ARGS, {}, None)
    assert SECRET not in str(error.value)


def test_serve_refuses_before_starting_anything_and_logs_no_secret(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serve.subprocess, "Popen", None)  # nothing may be started
    with caplog.at_level(logging.INFO):
        assert serve.main(["/models/tiny", "--kv-extra", json.dumps({"kv_secret": SECRET})]) == 2
    assert "kv_secret in --kv-extra would be visible" in caplog.text and SECRET not in caplog.text


def test_bad_kv_extra_is_reported_without_echoing_it(capsys: pytest.CaptureFixture) -> None:
    for text in ('{"kv_secret": "' + SECRET, json.dumps([SECRET])):
        with pytest.raises(SystemExit):
            args("--kv-extra", text)
        error = capsys.readouterr().err
        assert "--kv-extra" in error and SECRET not in error


def test_logged_command_lines_hide_api_keys() -> None:
    shown = serve.redacted(["vllm", "--api-key", "sk-one", "--api-key=sk-two", "--port", "8000"])
    assert "sk-one" not in shown and "sk-two" not in shown
    assert shown == "vllm --api-key '<redacted>' '--api-key=<redacted>' --port 8000"


def test_instance_environment_keeps_the_callers_and_adds_its_own() -> None:
    env = serve.instance_env({"PATH": "/bin", "KVBRIDGE_KV_SECRET_FILE": "/f"}, ["VLLM_CPU_OMP_THREADS_BIND=1"], None)
    assert env == {"PATH": "/bin", "VLLM_CPU_OMP_THREADS_BIND": "1"}
    with pytest.raises(KVConfigError, match="KEY=VALUE"):
        serve.instance_env({}, ["NOVALUE"], None)


# ---------------------------------------------------------------------------------------------- store


def extra_of(instance: serve.Instance) -> dict:
    return transfer_of(instance)["kv_connector_extra_config"]


def test_with_a_store_prefill_and_decode_instances_have_it_beside_their_pipe() -> None:
    spec = "memory,disk:/var/cache/kv,redis://127.0.0.1:6379"
    options = (
        "--prefill-instances",
        "2",
        "--decode-instances",
        "2",
        "--kv-store",
        spec,
        "--kv-extra",
        '{"kv_buffer_size": 1000000}',
    )
    instances = serve.plan(args(*options), SERVE_ARGS, {}, None)
    assert [transfer_of(i)["kv_role"] for i in instances] == ["kv_producer"] * 2 + ["kv_consumer"] * 2
    assert [transfer_of(i)["kv_port"] for i in instances] == [15000, 15001, 15000, 15000]
    assert [extra_of(i) for i in instances] == [{"kv_ip": "127.0.0.1", "kv_buffer_size": 1000000, "kv_store": spec}] * 4
    # Both load: a failed load is recomputed, never served from wrong KV.
    assert all(transfer_of(i)["kv_load_failure_policy"] == "recompute" for i in instances)
    # What the instances will parse: the store's and the pipe's settings accept their parts.
    StoreSettings.from_extra({"kv_store": extra_of(instances[0])["kv_store"]}, environ={})
    for instance in instances:
        transfer = transfer_of(instance)
        pipe = {key: value for key, value in extra_of(instance).items() if key != "kv_store"}
        ConnectorSettings.from_vllm(transfer["kv_role"], transfer["kv_port"], "cpu", pipe, environ={})


def test_a_store_no_two_processes_share_is_refused() -> None:
    with pytest.raises(KVConfigError, match="memory alone"):
        serve.plan(args("--kv-store", "memory"), SERVE_ARGS, {}, None)


def test_without_a_store_the_instances_get_no_store_setting() -> None:
    assert all("kv_store" not in extra_of(i) for i in serve.plan(args(), SERVE_ARGS, {}, None))


def test_the_managed_redis_is_named_by_url_and_its_password_goes_only_into_the_environment() -> None:
    url = "redis://127.0.0.1:23456"
    environ = {"HOME": "/h", serve.STORE_PASSWORD_FILE_ENV: "/etc/other-redis-password"}
    instances = serve.plan(
        args("--kv-store", "memory,redis"),
        SERVE_ARGS,
        environ,
        None,
        secret=serve.LaunchSecret(SECRET, generated=False),
        managed_redis=url,
    )
    password = redis_server.password_from_secret(SECRET)
    assert password != SECRET and SECRET not in password
    for instance in instances:
        assert extra_of(instance)["kv_store"] == f"memory,{url}"
        assert instance.env == {"HOME": "/h", "KVBRIDGE_KV_SECRET": SECRET, serve.STORE_PASSWORD_ENV: password}
        assert not any(password in arg or SECRET in arg for arg in instance.command)


def test_a_kv_store_object_in_kv_extra_sizes_the_tiers_that_kv_store_names() -> None:
    sizes = {"memory_bytes": 123 * MIB, "chunk_size": 128}
    (prefill, _) = serve.plan(
        args("--kv-store", "memory,disk:/x", "--kv-extra", json.dumps({"kv_store": sizes})), SERVE_ARGS, {}, None
    )
    assert extra_of(prefill)["kv_store"] == {**sizes, "tiers": "memory,disk:/x"}
    for given in ("disk:/x", {"tiers": "disk:/x"}):
        with pytest.raises(KVConfigError, match="give them once"):
            serve.plan(
                args("--kv-store", "memory,disk:/y", "--kv-extra", json.dumps({"kv_store": given})),
                SERVE_ARGS,
                {},
                None,
            )


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("memory,tape", "'tape' is not one of"),
        ("disk:", "'disk:' is not one of"),
        ("memory,memory", "two memory tiers"),
        ("redis,redis://10.0.0.5:6379", "two redis tiers"),
        ("redis://:" + SECRET + "@10.0.0.5:6379", "password in --kv-store would be visible"),
        ("redis://", "names no host"),
    ],
)
def test_a_store_that_cannot_work_is_refused_without_echoing_a_password(spec: str, match: str) -> None:
    with pytest.raises(KVConfigError, match=match) as error:
        serve.plan(args("--kv-store", spec), SERVE_ARGS, {}, None, managed_redis="redis://127.0.0.1:1")
    assert SECRET not in str(error.value)


@pytest.mark.parametrize("variable", ["KVBRIDGE_STORE_PASSWORD", "KVBRIDGE_STORE_PASSWORD_FILE"])
def test_a_store_password_on_the_command_line_is_refused(variable: str) -> None:
    with pytest.raises(KVConfigError, match="visible to every user"):
        serve.plan(args("--decode-env", f"{variable}={SECRET}"), SERVE_ARGS, {}, None)


@pytest.mark.parametrize("size", ["1gb\nrequirepass x", "-1", "lots", "0"])
def test_the_managed_redis_memory_must_be_a_size(size: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        args("--kv-store-redis-memory", size)
    assert "--kv-store-redis-memory must be a size" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- secure by default


def test_without_a_secret_every_instance_holds_the_same_generated_one() -> None:
    first = serve.plan(args("--prefill-instances", "2", "--decode-instances", "2"), SERVE_ARGS, {"HOME": "/h"}, None)
    secrets = {i.env.get("KVBRIDGE_KV_SECRET") for i in first}
    assert len(secrets) == 1 and None not in secrets
    (secret,) = secrets
    assert len(secret) >= 32
    assert all(secret not in arg for i in first for arg in i.command)
    second = serve.plan(args(), SERVE_ARGS, {"HOME": "/h"}, None)
    assert second[0].env["KVBRIDGE_KV_SECRET"] != secret  # one per launch


def test_the_generated_secret_derives_the_managed_redis_password() -> None:
    launch = serve.launch_secret({}, {})
    assert launch.generated and launch.value not in repr(launch)
    for instance in serve.plan(
        args("--kv-store", "redis"), SERVE_ARGS, {}, None, secret=launch, managed_redis="redis://127.0.0.1:23456"
    ):
        assert instance.env["KVBRIDGE_KV_SECRET"] == launch.value
        assert instance.env[serve.STORE_PASSWORD_ENV] == redis_server.password_from_secret(launch.value)


def warnings_of(caplog: pytest.LogCaptureFixture, *given: str, environ: dict | None = None) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="launch.serve"):
        serve.plan(args(*given), SERVE_ARGS, environ or {}, None, managed_redis="redis://127.0.0.1:23456")
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_an_address_beyond_loopback_that_has_only_a_generated_secret_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    (warning,) = warnings_of(caplog, "--kv-ip", "0.0.0.0")
    assert "0.0.0.0" in warning and "KVBRIDGE_KV_SECRET" in warning
    assert warnings_of(caplog, "--kv-ip", "0.0.0.0", environ={"KVBRIDGE_KV_SECRET": SECRET}) == []
    for loopback in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert warnings_of(caplog, "--kv-ip", loopback, "--kv-store", "memory,redis") == []


def test_a_store_beyond_loopback_without_a_password_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    given = {"KVBRIDGE_KV_SECRET": SECRET}
    (warning,) = warnings_of(caplog, "--kv-store", "redis://10.0.0.5:6379", environ=given)
    assert "redis://10.0.0.5:6379" in warning and "KVBRIDGE_STORE_PASSWORD" in warning
    assert (
        warnings_of(caplog, "--kv-store", "redis://10.0.0.5:6379", environ={**given, "KVBRIDGE_STORE_PASSWORD": "pw"})
        == []
    )
    assert warnings_of(caplog, "--kv-store", "redis://127.0.0.1:6379", environ=given) == []


@pytest.mark.parametrize("tier", ["disk:/var/cache/kv", "redis://127.0.0.1:6379"])
def test_a_store_that_outlives_the_launch_with_a_generated_secret_is_warned_about(
    tier: str, caplog: pytest.LogCaptureFixture
) -> None:
    (warning,) = warnings_of(caplog, "--kv-store", f"memory,{tier}")
    assert tier in warning and "another launch refuses them" in warning
    assert warnings_of(caplog, "--kv-store", f"memory,{tier}", environ={"KVBRIDGE_KV_SECRET": SECRET}) == []


def test_reserved_cores_are_kept_off_the_instances_for_kvbridges_threads() -> None:
    compute, reserved = serve.reserve_cores([3, 0, 2, 1], 1)
    assert (compute, reserved) == ([0, 1, 2], [3])
    instances = serve.plan(args("--reserved-cores", "1"), SERVE_ARGS, {}, None, compute, reserved_cores=reserved)
    assert [i.env[serve.BIND_ENV] for i in instances] == ["0", "1"]
    for instance in instances:
        extra = json.loads(option(instance.command, "--kv-transfer-config"))["kv_connector_extra_config"]
        assert extra["kv_thread_cores"] == "3"
    # A kv_thread_cores of the user's stands.
    given = serve.plan(
        args("--kv-extra", '{"kv_thread_cores": "inherit"}'), SERVE_ARGS, {}, None, compute, reserved_cores=reserved
    )
    assert {
        json.loads(option(i.command, "--kv-transfer-config"))["kv_connector_extra_config"]["kv_thread_cores"]
        for i in given
    } == {"inherit"}
    # Without reserved cores nothing is set: kvbridge's threads choose (auto).
    plain = serve.plan(args(), SERVE_ARGS, {}, None, [0, 1, 2, 3])
    assert all("kv_thread_cores" not in option(i.command, "--kv-transfer-config") for i in plain)


@pytest.mark.parametrize(("cores", "reserved"), [([0, 1], 2), ([5], 1)])
def test_reserving_every_core_is_refused_naming_the_option(cores: list[int], reserved: int) -> None:
    with pytest.raises(KVConfigError, match=f"--reserved-cores {reserved} leaves no core for the instances"):
        serve.reserve_cores(cores, reserved)
    with pytest.raises(SystemExit):
        args("--reserved-cores", "-1")


def test_serve_refuses_to_reserve_every_core_before_starting_anything(caplog: pytest.LogCaptureFixture) -> None:
    assert serve.main(["/models/tiny", "--reserved-cores", "4096"]) == 2
    assert "--reserved-cores 4096 leaves no core for the instances" in caplog.text


def test_the_managed_redis_server_runs_on_the_cores_it_is_given() -> None:
    pinned = redis_server.ManagedRedis("p" * 16, cores=[2, 3])
    unpinned = redis_server.ManagedRedis("p" * 16)
    try:
        lines = pinned.config(pinned.directory).splitlines()
        assert "server_cpulist 2,3" in lines and "bio_cpulist 2,3" in lines
        assert not any("cpulist" in line for line in unpinned.config(unpinned.directory).splitlines())
    finally:
        pinned.stop()
        unpinned.stop()
