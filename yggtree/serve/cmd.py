"""``yggtree serve``: the OpenAI-compatible HTTP server (``yggtree.serve``).

The engine is chosen and built exactly as ``yggtree run`` builds it (the same flags:
``--plan``, ``--weights``, ``--drafter``, ...; ``run_cmd.build_from_args``), on the worker thread
that then serves every request; the server listens once the engine is ready.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from ..errors import YggError
from ..run_cmd import _float, _int_at_least, add_engine_arguments
from ..shapes import MAX_BATCH, SERVE_BATCH

AUTO_BATCH = SERVE_BATCH  # --max-batch's default where the engine can batch
SERVE_EXTRA = {"fastapi": "fastapi", "uvicorn": "uvicorn", "prometheus_client": "prometheus-client"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_int_at_least(0), default=8000, help="port (default 8000; 0: any free port)")
    p.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (default: the model file's or directory's name)")
    p.add_argument("--max-queue", type=_int_at_least(1), default=64,
                   help="requests that may wait for the engine; more get 429 with Retry-After (default 64)")
    p.add_argument("--max-batch", type=_int_at_least(1), default=None,
                   help=f"requests decoded at once, 1..{MAX_BATCH} (continuous batching; default {AUTO_BATCH}; a compiled "
                   "plan's batched graphs are built on the first start at a batch size, a few minutes once)")
    p.add_argument("--request-timeout", type=_float, default=600.0,
                   help="seconds a request may take, queueing included, before it ends with 504 (default 600)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default warning)")
    add_engine_arguments(p)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve the OpenAI API (completions, chat, streaming) over HTTP")
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def check_serve_extra() -> None:
    import importlib.util

    missing = [dist for mod, dist in SERVE_EXTRA.items() if importlib.util.find_spec(mod) is None]
    if missing:
        raise YggError(f"`yggtree serve` needs {', '.join(missing)} (the serve extra): "
                       "pip install 'yggtree[serve]'")


def model_name(args) -> str:
    """The name the API reports: ``--served-model-name``, else the model file's or directory's."""
    if args.served_model_name:
        return args.served_model_name
    from ..runtime.loading import resolve_model

    target = args.model
    if args.plan:
        from ..plan import load_plan

        target = load_plan(args.plan).target
    try:
        path = resolve_model(target).path
    except YggError:
        return str(target)
    return path.stem if path.suffix == ".gguf" else path.name


def compiled_batch(engine, max_batch: int):
    """A compiled engine's batch packages for ``max_batch`` requests at once (built where missing:
    once per plan and batch size, before the server listens); None for an eager engine or one
    request at a time."""
    if max_batch == 1 or not engine.graphs.compiled:
        return None
    from ..offline.batch_build import batch_packages

    return batch_packages(engine, max_batch)


def run(args) -> int:
    check_serve_extra()
    if args.request_timeout <= 0:
        raise YggError(f"--request-timeout must be > 0, got {args.request_timeout:g}")
    if args.max_batch is not None and args.max_batch > MAX_BATCH:
        raise YggError(f"--max-batch must be in 1..{MAX_BATCH}, got {args.max_batch}")
    import prometheus_client
    import uvicorn

    prometheus_client.disable_created_metrics()  # no *_created series, as vLLM (this process only)

    from ..run_cmd import build_from_args
    from .app import create_app
    from .metrics import Metrics
    from .scheduler import Backend, Scheduler

    t0 = time.perf_counter()
    name = model_name(args)

    def build() -> Backend:
        engine, tok, policy = build_from_args(args)
        max_batch = args.max_batch or AUTO_BATCH
        try:
            packages = compiled_batch(engine, max_batch)
            return Backend(engine, tok, policy, name, max_batch, packages)
        except YggError as e:  # this engine cannot batch exactly here: one request at a time
            if args.max_batch is not None:
                raise
            sys.stderr.write(f"yggtree: serving one request at a time ({e})\n")
            return Backend(engine, tok, policy, name, 1)

    def metrics(backend: Backend) -> Metrics:
        return Metrics(name, max_positions=backend.engine.envelope.d_max if backend.speculative else 1)

    scheduler = Scheduler(build, metrics, max_queue=args.max_queue, timeout=args.request_timeout).start()
    app = create_app(scheduler)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    startup = {"t0": t0}

    async def announce():  # once uvicorn listens: the start-up time and the address
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1] if server.servers else args.port
        b = scheduler.backend
        kind = "speculative" if b.speculative else "plain"
        sys.stderr.write(f"yggtree: serving {name} ({kind}, context {b.max_context}, batch {b.max_batch}) on "
                         f"http://{args.host}:{port}/v1 — ready in {time.perf_counter() - startup['t0']:.1f} s\n")
        sys.stderr.flush()

    async def main() -> None:
        task = asyncio.create_task(announce())
        try:
            await server.serve()
        finally:
            task.cancel()

    try:
        asyncio.run(main())
    finally:
        scheduler.stop()
    return 0
