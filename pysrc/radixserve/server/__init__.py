"""HTTP frontend: a starlette app serving the OpenAI-compatible and native routes over one
AsyncEngine, in the engine's own event loop. `create_app(engine)` builds it; `serve(args)` runs it."""
