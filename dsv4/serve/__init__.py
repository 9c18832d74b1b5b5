"""OpenAI-compatible HTTP server over the engine (``dsv4 serve``).

- :mod:`.protocol`: the wire format (pydantic models; the OpenAPI schema comes from them);
- :mod:`.async_engine`: one engine thread, a queue per response, abort on disconnect, drain;
- :mod:`.serving_completions`, :mod:`.serving_chat`: the endpoints' logic;
- :mod:`.app`: routes, the API-key / availability gate, OpenAI-style errors; :mod:`.metrics`;
- :mod:`.server`: uvicorn with a SIGTERM drain; :mod:`.cli`: the flags; :mod:`.bench`: ``dsv4 bench serve``.

Nothing here is imported by ``import dsv4``: FastAPI loads only when a server starts.
"""
