"""Server process handling of the experiment drivers, against real processes: readiness (HTTP and a
ready line), early exits, stopping a whole process group; and one workload through a real OpenAI-wire
server with the drivers' run path."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest

from alignedserve.bench.e2e.experiment import MODES, RunSet, StackLaunch
from alignedserve.bench.e2e.peers import ALIGNEDSERVE
from alignedserve.bench.e2e.runs import RunScale, Target, row_from, run_workload, select_workloads
from alignedserve.bench.e2e.servers import ServerProcess, ServerStartError, answers_models, free_port

# A server that spawns a long-lived child (as `alignedserve up` and vLLM do), says it is ready after a
# delay, and answers GET /v1/models.
TOY_SERVER = textwrap.dedent(
    """
    import http.server, subprocess, sys, time
    port, child_pid_file = int(sys.argv[1]), sys.argv[2]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    open(child_pid_file, "w").write(str(child.pid))
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.end_headers()
            self.wfile.write(b'{"data": []}')
        def log_message(self, *args):
            pass
    server = http.server.HTTPServer(("127.0.0.1", port), Handler)
    time.sleep(0.3)
    print("TOY ready", flush=True)
    server.serve_forever()
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_ready_then_stop_kills_the_whole_group(tmp_path: Path) -> None:
    script, child_pid_file = tmp_path / "toy.py", tmp_path / "child.pid"
    script.write_text(TOY_SERVER)
    port = free_port()
    server = ServerProcess(
        "toy",
        [sys.executable, str(script), str(port), str(child_pid_file)],
        f"http://127.0.0.1:{port}",
        tmp_path / "logs" / "toy.log",
        ready_line="TOY ready",
        ready_timeout_s=60,
        stop_timeout_s=0.5,  # the toy ignores nothing, but its child would outlive it without the group kill
    )
    with server:
        assert server.ready_after_s is not None and answers_models(server.base_url)
        child = int(child_pid_file.read_text())
        assert _alive(child)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    assert not answers_models(server.base_url)
    assert "TOY ready" in server.log_tail() and server.log_tail().startswith("\n=== ")


def test_a_server_that_exits_early_is_an_error_with_its_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    server = ServerProcess("broken", argv, f"http://127.0.0.1:{free_port()}", tmp_path / "broken.log")
    with pytest.raises(ServerStartError, match=r"exited with code 3(.|\n)*no model here"), server:
        pass


def test_a_server_that_never_answers_times_out_and_is_stopped(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    server = ServerProcess(
        "silent", argv, f"http://127.0.0.1:{free_port()}", tmp_path / "s.log", ready_timeout_s=1
    )
    with pytest.raises(ServerStartError, match="not ready after 1 s"), server:
        pass
    assert server.process is not None and server.process.poll() is not None


def test_stack_launch_commands_per_mode(tmp_path: Path) -> None:
    launch = StackLaunch(tmp_path, bus="kafka://127.0.0.1:9092", prefill=1, decode=2, metrics_base_port=9200)
    server = launch.server(MODES["aligned-noprefetch"], 8123)
    argv = list(server.argv)
    assert argv[1:4] == ["-m", "alignedserve.core.cli", "up"]
    assert argv[argv.index("--policy") + 1] == "aligned" and argv[argv.index("--prefetch") + 1] == "off"
    assert (
        argv[argv.index("--bus") + 1] == "kafka://127.0.0.1:9092"
        and server.ready_line == "AlignedServe ready:"
    )
    mode = MODES["aligned-noprefetch"]
    assert launch.metrics_urls(mode) == [f"http://127.0.0.1:{p}/metrics" for p in range(9200, 9205)]
    spill = replace(mode, cpu_layout="split-spill")  # one more prefill worker, after the decode workers
    assert launch.metrics_urls(spill) == [f"http://127.0.0.1:{p}/metrics" for p in range(9200, 9206)]


def test_workloads_through_a_real_openai_wire_server(conformance_server: str) -> None:
    """The drivers' run path: every workload replayed, rows without per-request records, lengths exact."""
    scale = RunScale(num_requests=4, length_scale=0.05, concurrency=2, max_output_len=8)
    runs = RunSet([], {})
    for workload in select_workloads(scale, None):
        result = run_workload(Target("wire", conformance_server), workload, scale, progress=False)
        runs.rows.append(row_from(ALIGNEDSERVE, workload.name, result))
        runs.records[(ALIGNEDSERVE, workload.name)] = result.records
    assert [(r.target, r.workload) for r in runs.rows] == [
        (ALIGNEDSERVE, "synthetic95"),
        (ALIGNEDSERVE, "azure-conv"),
    ]
    for row in runs.rows:
        assert row.summary["completed"] == 4 and row.summary["failed"] == 0
        assert "requests" not in row.summary and (row.get("output_throughput") or 0) > 0
    records = runs.records[(ALIGNEDSERVE, "synthetic95")]
    assert all(r.output_len == r.expected_output_len for r in records)


def test_an_earlier_runs_ready_line_in_the_same_log_does_not_count(tmp_path: Path) -> None:
    """A restarted stack answers /v1/models before its backend is ready: only this run's line counts."""
    script, child_pid_file = tmp_path / "toy.py", tmp_path / "child.pid"
    script.write_text(TOY_SERVER.replace('print("TOY ready", flush=True)', "pass"))  # never says ready
    log = tmp_path / "toy.log"
    log.write_text("=== an earlier run\nTOY ready\n")
    port = free_port()
    argv = [sys.executable, str(script), str(port), str(child_pid_file)]
    server = ServerProcess(
        "toy", argv, f"http://127.0.0.1:{port}", log, ready_line="TOY ready", ready_timeout_s=2
    )
    with pytest.raises(ServerStartError, match="not ready after 2 s"), server:
        pass
