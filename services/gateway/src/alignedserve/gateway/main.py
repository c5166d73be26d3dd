"""`alignedserve gateway`: the OpenAI-compatible HTTP API in front of the stack (or an in-process engine).

Start: config -> logging -> backend (and tokenizer) -> HTTP server. /health answers from the moment the
server listens; /ready only once the backend is ready. SIGTERM: /ready turns 503 and new requests get
503, in-flight requests finish (at most --drain-timeout-s), then the server and the backend stop.
"""

from __future__ import annotations

import asyncio
import sys

from alignedserve.core.config import ConfigError, settings_or_exit_code
from alignedserve.core.models import ModelLoadError
from alignedserve.gateway.app import create_app
from alignedserve.gateway.backend import GenerationBackend
from alignedserve.gateway.config import GatewaySettings
from alignedserve.gateway.tokenizer import PromptTokenizer, load_prompt_tokenizer
from alignedserve.service import loop
from alignedserve.service.drain import Drain, exit_on_stuck_teardown
from alignedserve.service.http import HttpServer
from alignedserve.service.logs import configure_logging, get_logger

log = get_logger("alignedserve.gateway")


def main(argv: list[str]) -> int:
    settings = settings_or_exit_code(GatewaySettings, argv, "alignedserve gateway", __doc__)
    if isinstance(settings, int):  # bad config (2) or --check-config (0)
        return settings
    configure_logging("gateway", settings.log_level, settings.log_format)
    exit_on_stuck_teardown()
    try:
        return loop.run(serve(settings), settings.event_loop)
    except (ConfigError, ModelLoadError) as exc:
        print(f"alignedserve gateway: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


async def serve(settings: GatewaySettings) -> int:
    drain = Drain(settings.drain_timeout_s)
    drain.install_signal_handlers()
    backend, tokenizer = await build_backend(settings)
    app = create_app(settings, backend, tokenizer, drain)
    server = HttpServer(app, settings.host, settings.port, log_level=settings.log_level)
    await server.start()
    log.info("gateway_listening", url=f"{server.url}/v1", backend=settings.backend, model=settings.model_name)
    try:
        await drain.wait_begun()
        await drain.wait_idle()
    finally:
        await server.stop()
        await backend.close()
    log.info("gateway_stopped")
    return 0


async def build_backend(settings: GatewaySettings) -> tuple[GenerationBackend, PromptTokenizer]:
    """Start the configured backend; return it with the tokenizer the gateway validates prompts with."""
    if settings.backend == "engine":
        return await _engine_backend(settings)
    return await _bus_backend(settings)


async def _engine_backend(settings: GatewaySettings) -> tuple[GenerationBackend, PromptTokenizer]:
    # Imported here, only for this backend: it brings the engine and torch (the `engine` extra).
    try:
        from alignedserve.gateway.engine_backend import EngineBackend, engine_config
    except ImportError as exc:
        raise ConfigError(
            f"--backend engine needs the engine (pip install 'alignedserve-gateway[engine]'): {exc}"
        ) from None

    backend = EngineBackend(engine_config(settings))
    await backend.start()
    return backend, backend.prompt_tokenizer()


async def _bus_backend(settings: GatewaySettings) -> tuple[GenerationBackend, PromptTokenizer]:
    from alignedserve.bus import make_bus
    from alignedserve.gateway.bus_backend import BusBackend, BusBackendOptions

    tokenizer = await asyncio.to_thread(
        load_prompt_tokenizer, settings.model, settings.tokenizer, settings.max_model_len
    )
    # the deployment's namespace: its topics and groups are apart from other stacks on the broker
    bus = make_bus(settings.bus, settings.deployment)
    backend = BusBackend(bus, BusBackendOptions.from_settings(settings))
    await backend.start()
    return backend, tokenizer
