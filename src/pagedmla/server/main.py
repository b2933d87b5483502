"""Start the server: the engine, the app, uvicorn; SIGTERM or Ctrl-C drains it."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

import uvicorn

from pagedmla.engine.args import EngineArgs
from pagedmla.engine.llm import LLM
from pagedmla.engine.online import OnlineEngine
from pagedmla.models.loader import checkpoint_dir
from pagedmla.server.app import build_app
from pagedmla.server.chat import load_chat_renderer

logger = logging.getLogger(__name__)

# Seconds uvicorn waits on SIGTERM for the requests in flight to finish.
GRACEFUL_SHUTDOWN_S = 60


class _Server(uvicorn.Server):
    """uvicorn's server, except that a SIGTERM or SIGINT that stopped it is not raised
    again once it has drained: that is how the server is meant to stop, and the engine
    is then closed and the process exits with status 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def serve(engine_args: EngineArgs, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, served_model_name: str | None = None,
          log_level: str = "info") -> int:
    """Serve `engine_args.model` until SIGTERM or Ctrl-C; the requests in flight are
    finished first. Returns the exit status (0)."""
    llm = LLM(engine_args)
    engine = OnlineEngine(llm)
    try:
        chat = load_chat_renderer(checkpoint_dir(engine_args.model), llm.config.model_type)
        app = build_app(engine, served_model_name or str(engine_args.model), chat, api_key)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        _Server(config).run()
    finally:
        engine.close(drain=True)
        llm.close()
    return 0
