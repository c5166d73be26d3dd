"""Scaffolding every service shares: config, JSON logging, health/ready/metrics HTTP, SIGTERM drain.

The shape of a service's `main(argv)` (the gateway's `main.py` is a complete example)::

    class DecodeSettings(WorkerSettings):           # config.py: flags, ALIGNEDSERVE_[DECODE_]* env vars,
        service_name: ClassVar[str] = "decode"      # --config FILE.toml
        max_batch: int = Field(128, ge=1, description="...")

    def main(argv: list[str]) -> int:               # entry.run_service does all of this
        settings = settings_or_exit_code(DecodeSettings, argv, "alignedserve decode")
        if isinstance(settings, int):                # 2: bad config, message names the flag and env vars
            return settings                          # 0: --check-config printed the configuration
        configure_logging("decode", settings.log_level, settings.log_format)     # logs.py
        return loop.run(serve(settings), settings.event_loop)  # loop.py: uvloop

    async def serve(settings: DecodeSettings) -> int:
        drain = Drain(settings.drain_timeout_s)      # drain.py: SIGTERM -> draining
        drain.install_signal_handlers()
        registry = CollectorRegistry()               # the service's own Prometheus metrics
        server = HttpServer(ops_app("decode", worker.ready, registry, drain),   # http.py
                            settings.metrics_host, settings.metrics_port)
        await server.start()                         # /health, /ready, /metrics
        ...                                          # run; wrap each unit of work in `with drain.track():`
        await drain.wait_begun()                     # SIGTERM: /ready is 503 from now on
        await drain.wait_idle()                      # in-flight work finishes (bounded)
        await server.stop()
        return 0

Inside a request handler, `with request_context(request_id):` puts the request id on every log line.
"""

from __future__ import annotations
