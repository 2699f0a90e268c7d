"""The gateway: the chat's web server (Starlette), sessions in Redis, and the client
side of the engine's internal protocol. Build it with ``gateway.server.app.create_app``."""
