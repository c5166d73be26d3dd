"""`alignedserve up`: the environment each service process starts with."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import get_args

import pytest

from alignedserve.core.cpu_layout import LAYOUTS, engines_share_cores, layout_named
from alignedserve.engine.config import cpu_has_amx_bf16, resolve_dtype
from alignedserve.up import main as up
from alignedserve.up.config import UpSettings


def config(device: str = "cpu") -> UpSettings:
    return up.parse_args(["--device", device, "--log-dir", str(Path("/tmp/unused"))])


def commands(cfg: UpSettings) -> dict[str, list[str]]:
    return {name: argv for name, _, argv in up.service_commands(cfg, "redis://127.0.0.1:6379/0")}


def test_engines_sharing_cores_wait_passively_and_the_other_services_are_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cfg = up.parse_args(["--cpu-layout", "shared", "--log-dir", "/tmp/unused"])
    envs = {name: up.engine_env(cfg, argv) for name, argv in commands(cfg).items()}
    assert envs["prefill-0"] == envs["decode-0"] == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert envs["gateway"] == envs["kvpool-0"] == envs["batcher-0"] == {}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_an_engine_on_cores_of_its_own_keeps_openmps_default_wait(
    layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    cfg = up.parse_args(["--cpu-layout", layout, "--log-dir", "/tmp/unused"])
    started = commands(cfg)
    engines = [name for name in started if name.startswith(("prefill-", "decode-"))]
    cores = {name: set(started[name][started[name].index("--cpus") + 1].split(",")) for name in engines}
    shared = any(cores[a] & cores[b] for a in engines for b in engines if a < b)
    assert shared == engines_share_cores(LAYOUTS[layout], [0, 1, 2, 3])
    assert shared == (layout not in ("split", "split-decode-alone", "split-pool-with-decode"))
    expected = {"OMP_WAIT_POLICY": "PASSIVE"} if shared else {}
    assert all(up.engine_env(cfg, started[name]) == expected for name in engines)


def test_two_workers_of_one_role_share_its_cores_and_wait_passively(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    cfg = up.parse_args(["--cpu-layout", "split", "--prefill", "2", "--log-dir", "/tmp/unused"])
    started = commands(cfg)
    assert started["prefill-0"][-6:] == started["prefill-1"][-6:]  # the same prefill cores
    assert up.engine_env(cfg, started["decode-0"]) == {"OMP_WAIT_POLICY": "PASSIVE"}
    one_cpu = up.parse_args(["--cpu-layout", "split", "--log-dir", "/tmp/unused"])
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda _pid: {0})
    assert up.engine_env(one_cpu, commands(one_cpu)["decode-0"]) == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_what_the_user_exported_wins_and_gpus_get_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    cfg = config()
    assert up.engine_env(cfg, commands(cfg)["decode-0"]) == {}
    monkeypatch.delenv("OMP_WAIT_POLICY")
    gpu = config("cuda")
    assert up.engine_env(gpu, commands(gpu)["decode-0"]) == {}


def test_cpu_engines_get_their_layouts_placement_and_the_rest_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    split = commands(up.parse_args(["--cpu-layout", "split", "--log-dir", "/tmp/unused"]))
    assert split["prefill-0"][-6:] == ["--num-threads", "2", "--cpus", "0,1", "--nice", "0"]
    assert split["decode-0"][-6:] == ["--num-threads", "2", "--cpus", "2,3", "--nice", "0"]
    assert "--cpus" not in split["gateway"] and "--cpus" not in split["batcher-0"]
    cfg = config()
    auto = commands(cfg)
    # this host's dtype and tiles pick auto's layout; a turn-taking layout's lock flags come last
    expected = layout_named("auto", resolve_dtype("auto", "cpu"), 4, cpu_has_amx_bf16())
    for role, name in (("prefill", "prefill-0"), ("decode", "decode-0")):
        end = len(auto[name]) - len(up.turn_args(cfg, expected, role))
        assert auto[name][end - 6 : end] == expected.place(role, [0, 1, 2, 3]).engine_args()
    gpu = commands(config("cuda"))
    assert "--cpus" not in gpu["decode-0"] and "--num-threads" not in gpu["prefill-0"]


def on_two_cpus(monkeypatch: pytest.MonkeyPatch, layout: str) -> tuple[UpSettings, dict[str, list[str]]]:
    """`up`'s settings under `--cpu-layout layout` on a 2-CPU host, and the commands it starts."""
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda _pid: {0, 1})
    cfg = up.parse_args(["--cpu-layout", layout, "--log-dir", "/tmp/unused"])
    return cfg, commands(cfg)


def test_split_spill_starts_a_second_prefill_worker_on_the_decode_cores_after_decode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg, started = on_two_cpus(monkeypatch, "split-spill")
    assert started["prefill-0"][-8:-4] == ["--num-threads", "1", "--cpus", "0"]
    assert started["prefill-1"][-8:-4] == started["decode-0"][-6:-2] == ["--num-threads", "1", "--cpus", "1"]
    order = [name for name, _, _ in up.service_commands(cfg, "redis://127.0.0.1:6379/0")]
    assert order.index("prefill-1") > order.index("decode-0")  # decode keeps its metrics port
    # the prefill core leaves prompts on the bus beyond a forward's worth; the spill engine takes those
    assert started["prefill-0"][-2:] == ["--max-backlog-tokens", str(up.SPILL_BACKLOG_TOKENS)]
    assert started["prefill-1"][-2:] == ["--intake", "idle"]
    split = on_two_cpus(monkeypatch, "split")[1]
    assert "--max-backlog-tokens" not in split["prefill-0"] and "--intake" not in split["prefill-0"]


def test_split_decode_alone_pins_the_other_services_to_the_prefill_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg, started = on_two_cpus(monkeypatch, "split-decode-alone")
    assert started["prefill-0"][-6:-2] == ["--num-threads", "1", "--cpus", "0"]
    assert started["decode-0"][-6:-2] == ["--num-threads", "1", "--cpus", "1"]
    assert "prefill-1" not in started  # no spill engine
    for name in ("gateway", "kvpool-0", "batcher-0"):
        assert up.service_cpus(cfg, started[name]) == (0,)
    assert up.service_cpus(cfg, started["decode-0"]) == ()  # an engine pins itself


def test_split_pool_with_decode_pins_the_kv_pool_to_the_decode_core(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, started = on_two_cpus(monkeypatch, "split-pool-with-decode")
    assert started["prefill-0"][-6:-2] == ["--num-threads", "1", "--cpus", "0"]
    assert started["decode-0"][-6:-2] == ["--num-threads", "1", "--cpus", "1"]
    assert up.service_cpus(cfg, started["kvpool-0"]) == (1,)
    for name in ("gateway", "batcher-0"):
        assert up.service_cpus(cfg, started[name]) == (0,)


def lock_args(cfg: UpSettings) -> list[str]:
    """The flag that makes an engine take turns: one lock file per stack, beside its logs."""
    return ["--prefill-first-lock", str(cfg.log_dir.resolve() / up.PREFILL_FIRST_LOCK)]


def test_prefill_first_gives_every_engine_one_lock_beside_the_logs_and_other_layouts_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg, first = on_two_cpus(monkeypatch, "prefill-first")
    assert first["prefill-0"][-2:] == first["decode-0"][-2:] == lock_args(cfg)
    assert "--prefill-first-lock" not in first["gateway"] + first["kvpool-0"] + first["batcher-0"]
    assert "--prefill-first-max-wait-ms" not in first["decode-0"]  # the decode worker's default bound
    for name in ("shared", "split", "split-spill"):
        started = on_two_cpus(monkeypatch, name)[1]
        assert not any("--prefill-first-lock" in argv for argv in started.values())


def test_prefill_leads_gives_decode_its_100_ms_bound_beside_the_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, leads = on_two_cpus(monkeypatch, "prefill-leads")
    assert leads["prefill-0"][-2:] == lock_args(cfg)
    assert leads["decode-0"][-4:] == [*lock_args(cfg), "--prefill-first-max-wait-ms", "100"]


def test_split_spill_first_has_the_spill_engine_and_decode_take_turns_and_the_prefill_core_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg, started = on_two_cpus(monkeypatch, "split-spill-first")
    lock = lock_args(cfg)
    wait = str(LAYOUTS["split-spill-first"].turns.max_wait_ms)
    assert started["prefill-1"][-2:] == ["--intake", "idle"] and started["prefill-1"][-4:-2] == lock
    assert started["decode-0"][-4:] == [*lock, "--prefill-first-max-wait-ms", wait]
    assert "--prefill-first-lock" not in started["prefill-0"]  # its own core: it waits for no one
    assert started["prefill-0"][-2:] == ["--max-backlog-tokens", str(up.SPILL_BACKLOG_TOKENS)]


def test_up_offers_exactly_the_layouts_there_are() -> None:
    choices = get_args(UpSettings.model_fields["cpu_layout"].annotation)
    assert set(choices) == {"auto", *LAYOUTS}


def test_a_reply_that_is_not_http_is_not_ready() -> None:
    """A readiness probe that reads something other than an HTTP status line (its own request, when it
    connected to itself on an ephemeral port with no listener yet) says "not ready" rather than raising."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]

        def echo_once() -> None:
            conn, _ = server.accept()
            with conn:
                conn.sendall(conn.recv(4096))

        echo = threading.Thread(target=echo_once, daemon=True)
        echo.start()
        assert up.is_ready(f"http://127.0.0.1:{port}/ready") is False
        echo.join(timeout=5)


def test_the_other_services_are_pinned_to_the_layouts_service_cpus_and_engines_pin_themselves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    split = up.parse_args(["--cpu-layout", "split", "--log-dir", "/tmp/unused"])
    pinned = {name: up.service_cpus(split, argv) for name, argv in commands(split).items()}
    assert pinned == {
        "kvpool-0": (2, 3),
        "batcher-0": (2, 3),
        "gateway": (2, 3),
        "prefill-0": (),
        "decode-0": (),
    }
    shared = up.parse_args(["--cpu-layout", "shared", "--log-dir", "/tmp/unused"])
    assert up.service_cpus(shared, commands(shared)["gateway"]) == (0, 1, 2, 3)
    assert up.service_cpus(config("cuda"), commands(config("cuda"))["gateway"]) == ()


def test_prefetch_auto_pulls_ahead_in_the_decode_worker_on_cpus_and_stages_on_gpus() -> None:
    def prefetch(cfg: UpSettings) -> tuple[str, bool]:
        started = commands(cfg)
        batcher = started["batcher-0"]
        return batcher[batcher.index("--prefetch") + 1], "--prefetch-from-pool" in started["decode-0"]

    assert config().prefetch == "auto"
    assert prefetch(config()) == ("off", True)
    assert prefetch(config("cuda")) == ("on", False)
    for chosen, expected in (("on", ("on", False)), ("off", ("off", False)), ("decode", ("off", True))):
        cfg = up.parse_args(["--prefetch", chosen, "--log-dir", "/tmp/unused"])
        assert prefetch(cfg) == expected
