"""``yggtree serve``: an OpenAI-compatible HTTP server over one engine.

``cmd`` is the subcommand (flags, start-up), ``app`` the FastAPI application (endpoints, request
validation, server-sent events), ``scheduler`` the worker thread that owns the engine and serves
queued requests in turn, step by step, ``text`` incremental detokenization with stop strings and
``metrics`` the Prometheus metrics. FastAPI and uvicorn come with the ``serve`` extra
(``pip install 'yggtree[serve]'``).
"""
